//! Parsing durations from the command line: a number and a unit, `250ms`, `20s`, `1.5m`,
//! `1h` (`us`/`µs` also accepted).

use std::time::Duration;

/// Parses `<number><unit>` with unit `us`, `µs`, `ms`, `s`, `m` or `h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration {s:?} has no unit; write e.g. 250ms, 20s, 1.5m"))?;
    let (number, unit) = s.split_at(split);
    let value: f64 = number.parse().map_err(|_| format!("duration {s:?} does not start with a number"))?;
    let seconds = match unit.trim() {
        "us" | "µs" => value / 1e6,
        "ms" => value / 1e3,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        other => return Err(format!("unknown duration unit {other:?} in {s:?}; use us, ms, s, m or h")),
    };
    let duration = Duration::try_from_secs_f64(seconds).map_err(|e| format!("duration {s:?}: {e}"))?;
    // Past this, a deadline or a timer's next tick would not fit an `Instant`.
    if duration > MAX_DURATION {
        return Err(format!("duration {s:?} is longer than 100 years"));
    }
    Ok(duration)
}

/// The longest duration taken: 100 years.
const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_rejects_the_rest() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("20s"), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("1.5m"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("10us"), Ok(Duration::from_micros(10)));
        for bad in ["", "20", "s", "20 parsecs", "1.2.3s", "10000000000000000000s", "876601h"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
