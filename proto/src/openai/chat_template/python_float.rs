//! Floats spelled as Python spells them (`repr`, which `str` and `json.dumps` share), so a
//! number a template writes out (`{{ x }}`), through `string` or through `tojson` is the
//! text vLLM's Jinja2 writes: `1e-05`, `1e+16`, `100.0`. Rust and serde_json agree with
//! Python on the digits (the shortest that read back the same) but not on where scientific
//! notation starts or how its exponent is written. Not covered (minijinja has no hook there):
//! a float inside a list or map written out whole, joined with `~` or `join`, or through
//! `safe`.

/// `repr(x)` of a Python float. (`tojson` never gets a non-finite one: serde_json writes
/// those as `null`, where Python writes `NaN` and `Infinity`; no JSON input holds them.)
pub(super) fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".to_owned();
    }
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if x.is_infinite() {
        return format!("{sign}inf");
    }
    // `{:e}` gives the shortest round-tripping digits as `d[.ddd]e<exp>`.
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` writes an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` writes an integer exponent");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    // CPython's `float_repr_style = 'short'`: fixed notation for 1e-4 <= |x| < 1e16.
    if !(-4..16).contains(&exp) {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{mantissa}e{exp_sign}{:02}", exp.unsigned_abs());
    }
    if exp < 0 {
        let zeros = "0".repeat(exp.unsigned_abs() as usize - 1);
        return format!("{sign}0.{zeros}{digits}");
    }
    let point = exp as usize + 1;
    if digits.len() <= point {
        let zeros = "0".repeat(point - digits.len());
        format!("{sign}{digits}{zeros}.0")
    } else {
        format!("{sign}{}.{}", &digits[..point], &digits[point..])
    }
}

#[cfg(test)]
mod tests {
    use super::python_float;

    /// Expected strings are CPython 3's `repr` of the same floats.
    #[test]
    fn spelled_as_python_repr() {
        let cases = [
            (1e-05, "1e-05"),
            (0.0001, "0.0001"),
            (0.00012, "0.00012"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.5e16, "1.5e+16"),
            (123.456, "123.456"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e100, "1e+100"),
            (2.5e-300, "2.5e-300"),
            (100.0, "100.0"),
            (1234567890123456.7, "1234567890123456.8"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (12345678901234567.0, "1.2345678901234568e+16"),
        ];
        for (x, want) in cases {
            assert_eq!(python_float(x), want, "{x:?}");
        }
    }

    #[test]
    fn non_finite_as_repr() {
        assert_eq!(python_float(f64::NAN), "nan");
        assert_eq!(python_float(f64::NEG_INFINITY), "-inf");
        assert_eq!(python_float(f64::INFINITY), "inf");
    }
}
