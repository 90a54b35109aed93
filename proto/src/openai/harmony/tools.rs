//! A gpt-oss request's functions as Harmony writes them into the developer message: a
//! `functions` namespace of TypeScript types, each function's JSON-schema parameters turned
//! into a TypeScript type the way `oss-harmony` 0.0.11 turns them (the package vLLM 0.33
//! renders gpt-oss prompts with).
//!
//! Every character lands in the prompt the replica caches, so the schema is read exactly as
//! oss-harmony reads it, including what it leaves out or writes oddly:
//!
//! - Properties keep the request's order (a key given twice: its first place, its last
//!   value). Optional ones get `?`; `title`, `description` and string `examples` become `//`
//!   comments above them, `default` a comment after them.
//! - `oneOf` lists its variants on lines of their own (` | `), with each variant's
//!   description and default after it; a property's own description is written above it
//!   unless its first variant has the same one.
//! - `type` may be a list (joined with `|`); `integer` is `number`; a string's `enum`
//!   becomes its string values in quotes; an array without `items` is `Array<any>`; `anyOf`,
//!   `$ref`, `null` and anything else unknown is `any`. `nullable: true` adds `| null`.
//! - An object's description is a comment right before its `{`, on the same line as the
//!   property it belongs to.
//! - Strings are written as they are, without escaping, except a string default of an enum
//!   in a top-level `oneOf` variant, which is written as JSON.

use std::fmt::Write;

use serde::Deserialize;
use serde_json::Value;

/// A function the request offers (vLLM's `ChatCompletionToolsParam`, whose `type` can only
/// be `function`).
#[derive(Debug, Deserialize)]
pub struct Tool {
    #[serde(rename = "type", default = "function_type", deserialize_with = "function_only")]
    _kind: (),
    function: Function,
}

#[derive(Debug, Deserialize)]
struct Function {
    name: String,
    description: Option<String>,
    /// An object (or none): anything else vLLM refuses.
    #[serde(default, deserialize_with = "object_or_null")]
    parameters: Option<Value>,
}

fn object_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Ok(Option::<serde_json::Map<String, Value>>::deserialize(d)?.map(Value::Object))
}

fn function_type() {}

fn function_only<'de, D: serde::Deserializer<'de>>(d: D) -> Result<(), D::Error> {
    match String::deserialize(d)?.as_str() {
        "function" => Ok(()),
        other => Err(serde::de::Error::custom(format!("tool type {other:?} is not \"function\""))),
    }
}

impl Tool {
    /// The request's `tools` (null is none), or `None` when vLLM would refuse them.
    pub fn list(raw: &str) -> Option<Vec<Tool>> {
        serde_json::from_str::<Option<Vec<Tool>>>(raw).ok().map(Option::unwrap_or_default)
    }
}

/// The developer message's `# Tools` section for `tools` (not empty).
pub fn section(tools: &[Tool]) -> String {
    let mut out = String::from("# Tools\n\n## functions\n\nnamespace functions {\n\n");
    for tool in tools {
        let f = &tool.function;
        for line in f.description.as_deref().unwrap_or_default().lines() {
            let _ = writeln!(out, "// {line}");
        }
        match &f.parameters {
            Some(schema) => {
                let _ = writeln!(out, "type {} = (_: {}) => any;\n", f.name, typescript(schema, ""));
            }
            None => {
                let _ = writeln!(out, "type {} = () => any;\n", f.name);
            }
        }
    }
    out.push_str("} // namespace functions");
    out
}

/// `schema` as a TypeScript type, its lines indented by `indent`.
fn typescript(schema: &Value, indent: &str) -> String {
    if let Some(variants) = schema.get("oneOf").and_then(Value::as_array) {
        let mut out = String::new();
        for variant in variants {
            let _ =
                write!(out, "\n{indent} | {}", nullable(variant, typescript(variant, &deeper(indent, 3))));
            let mut notes: Vec<String> =
                text(variant, "description").map(str::to_owned).into_iter().collect();
            notes.extend(
                variant.get("default").map(|d| format!("default: {}", default_note(variant, d, true))),
            );
            trailing(&mut out, &notes);
        }
        return out;
    }
    if let Some(types) = schema.get("type").and_then(Value::as_array) {
        let names: Vec<&str> = types.iter().filter_map(Value::as_str).map(number_for_integer).collect();
        if !names.is_empty() {
            return names.join(" | ");
        }
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => object(schema, indent),
        Some("string") => {
            let values: Vec<String> = schema
                .get("enum")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(|s| format!("\"{s}\""))
                .collect();
            if values.is_empty() { "string".to_owned() } else { values.join(" | ") }
        }
        Some("number" | "integer") => "number".to_owned(),
        Some("boolean") => "boolean".to_owned(),
        Some("array") => match schema.get("items") {
            Some(items) => format!("{}[]", typescript(items, indent)),
            None => "Array<any>".to_owned(),
        },
        _ => "any".to_owned(),
    }
}

/// An object schema: `{`, a line for each property, `}`.
fn object(schema: &Value, indent: &str) -> String {
    let mut out = String::new();
    if let Some(description) = text(schema, "description") {
        let _ = writeln!(out, "{indent}// {description}");
    }
    out.push_str("{\n");
    if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        for (key, property) in properties {
            let optional = if required.contains(&key.as_str()) { "" } else { "?" };
            property_line(&mut out, indent, &format!("{key}{optional}"), property);
        }
    }
    out.push_str(indent);
    out.push('}');
    out
}

/// One property of an object: its comments, then `name: type,` (or its `oneOf` variants).
fn property_line(out: &mut String, indent: &str, name: &str, property: &Value) {
    if let Some(title) = text(property, "title") {
        let _ = write!(out, "{indent}// {title}\n{indent}//\n");
    }
    let one_of = property.get("oneOf");
    if one_of.is_none()
        && let Some(description) = text(property, "description")
    {
        let _ = writeln!(out, "{indent}// {description}");
    }
    if let Some(examples) = property.get("examples").and_then(Value::as_array).filter(|e| !e.is_empty()) {
        let _ = writeln!(out, "{indent}// Examples:");
        for example in examples.iter().filter_map(Value::as_str) {
            let _ = writeln!(out, "{indent}// - \"{example}\"");
        }
    }
    if let Some(variants) = one_of.and_then(Value::as_array) {
        return one_of_property(out, indent, name, property, variants);
    }
    let _ = write!(out, "{indent}{name}: {},", nullable(property, typescript(property, &deeper(indent, 4))));
    if one_of.is_none()
        && let Some(default) = property.get("default")
    {
        let _ = write!(out, " // default: {}", default_note(property, default, false));
    }
    out.push('\n');
}

/// A property that is one of `variants`: its description above it unless its first variant
/// repeats it, its default, then a line per variant.
fn one_of_property(out: &mut String, indent: &str, name: &str, property: &Value, variants: &[Value]) {
    let own = text(property, "description");
    let repeated = own.is_some() && variants.first().and_then(|v| text(v, "description")) == own;
    let above = own.filter(|_| !repeated);
    if let Some(description) = above {
        let _ = writeln!(out, "{indent}// {description}");
    }
    if let Some(default) = property.get("default") {
        let _ = writeln!(out, "{indent}// default: {}", default_note(property, default, false));
    }
    let _ = writeln!(out, "{indent}{name}:");
    for (i, variant) in variants.iter().enumerate() {
        let _ = write!(out, "{indent} | {}", nullable(variant, typescript(variant, &deeper(indent, 3))));
        let mut notes = Vec::new();
        if !(i == 0 && above.is_some())
            && let Some(description) = text(variant, "description").filter(|d| Some(*d) != own)
        {
            notes.push(description.to_owned());
        }
        notes.extend(variant.get("default").map(|d| format!("default: {}", default_note(variant, d, false))));
        trailing(out, &notes);
        out.push('\n');
    }
    let _ = writeln!(out, "{indent},");
}

/// A default as its comment writes it: a string in quotes, as it is (an enum's bare, or as
/// JSON when `enum_as_json`), anything else as compact JSON.
fn default_note(schema: &Value, default: &Value, enum_as_json: bool) -> String {
    let is_enum = schema.get("enum").and_then(Value::as_array).is_some_and(|e| !e.is_empty());
    match default.as_str() {
        Some(s) if !is_enum => format!("\"{s}\""),
        Some(s) if !enum_as_json => s.to_owned(),
        _ => default.to_string(),
    }
}

/// `ts` with `| null` when the schema is `nullable` and `ts` does not say null already.
fn nullable(schema: &Value, ts: String) -> String {
    if schema.get("nullable").and_then(Value::as_bool) == Some(true) && !ts.contains("null") {
        format!("{ts} | null")
    } else {
        ts
    }
}

/// Appends ` // ` and `notes` joined by spaces, if there are any.
fn trailing(out: &mut String, notes: &[String]) {
    if !notes.is_empty() {
        let _ = write!(out, " // {}", notes.join(" "));
    }
}

fn text<'v>(schema: &'v Value, key: &str) -> Option<&'v str> {
    schema.get(key).and_then(Value::as_str)
}

fn number_for_integer(name: &str) -> &str {
    if name == "integer" { "number" } else { name }
}

fn deeper(indent: &str, by: usize) -> String {
    format!("{indent}{:by$}", "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ts(schema: Value) -> String {
        typescript(&schema, "")
    }

    #[test]
    fn properties_keep_the_requests_order_and_mark_the_optional_ones() {
        let tools = Tool::list(
            r#"[{"type":"function","function":{"name":"f","parameters":
                {"type":"object","properties":{"zeta":{"type":"integer"},"alpha":{"type":"string"}},"required":["zeta"]}}}]"#,
        )
        .unwrap();
        assert_eq!(
            section(&tools),
            "# Tools\n\n## functions\n\nnamespace functions {\n\n\
             type f = (_: {\nzeta: number,\nalpha?: string,\n}) => any;\n\n} // namespace functions"
        );
    }

    #[test]
    fn scalars_lists_and_unknowns() {
        assert_eq!(ts(json!({"type": ["string", "integer", 3]})), "string | number");
        assert_eq!(ts(json!({"type": "string", "enum": ["a", 1, "b"]})), "\"a\" | \"b\"");
        assert_eq!(ts(json!({"type": "string", "enum": []})), "string");
        assert_eq!(ts(json!({"type": "array"})), "Array<any>");
        assert_eq!(
            ts(json!({"type": "array", "items": {"type": "array", "items": {"type": "boolean"}}})),
            "boolean[][]"
        );
        assert_eq!(ts(json!({"anyOf": [{"type": "string"}]})), "any");
        assert_eq!(ts(json!({"type": "null"})), "any");
        assert_eq!(ts(json!({"type": []})), "any");
    }

    #[test]
    fn defaults_are_quoted_bare_or_json_by_where_they_are() {
        let schema = json!({"type": "object", "properties": {
            "s": {"type": "string", "default": "x\"y"},
            "e": {"type": "string", "enum": ["a"], "default": "a"},
            "o": {"type": "object", "default": {"b": [1, null]}},
        }});
        assert_eq!(
            ts(schema),
            "{\ns?: string, // default: \"x\"y\"\ne?: \"a\", // default: a\no?: {\n    }, // default: {\"b\":[1,null]}\n}"
        );
        let top = json!({"oneOf": [{"type": "string", "enum": ["a"], "default": "a", "description": "d"}]});
        assert_eq!(ts(top), "\n | \"a\" // d default: \"a\"");
    }

    #[test]
    fn a_property_description_repeated_by_its_first_variant_is_written_once() {
        let schema = json!({"type": "object", "properties": {
            "t": {"description": "D", "oneOf": [{"type": "string", "description": "D"}, {"type": "number", "description": "N", "nullable": true}]},
            "u": {"description": "U", "oneOf": [{"type": "string", "description": "V"}, {"type": "number", "description": "U"}]},
        }, "required": ["t"]});
        assert_eq!(
            ts(schema),
            "{\nt:\n | string\n | number | null // N\n,\n// U\nu?:\n | string\n | number\n,\n}"
        );
    }

    #[test]
    fn tools_vllm_would_refuse_are_not_read() {
        assert!(Tool::list(r#"[{"type":"retrieval","function":{"name":"f"}}]"#).is_none());
        assert!(Tool::list(r#"[{"function":{"description":"no name"}}]"#).is_none());
        assert!(Tool::list(r#"[{"function":{"name":"f","parameters":[1]}}]"#).is_none());
        assert!(Tool::list(r#"{"function":{"name":"f"}}"#).is_none());
        assert_eq!(Tool::list("null").map(|t| t.len()), Some(0));
        assert_eq!(
            Tool::list(r#"[{"function":{"name":"f","description":null,"parameters":null}}]"#)
                .map(|t| t.len()),
            Some(1)
        );
    }
}
