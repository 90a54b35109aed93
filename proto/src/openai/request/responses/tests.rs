use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::Responses;
use crate::openai::error::RequestError;
use crate::openai::{ChatRequest, Endpoint, Tokenization};

fn chat(body: Value) -> Value {
    let body = body.to_string();
    let request = Responses::read(body.as_bytes()).unwrap();
    serde_json::from_slice(&request.chat_body(&[])).unwrap()
}

fn tokenization() -> Tokenization {
    Tokenization::new(&Default::default()).unwrap()
}

#[test]
fn instructions_lead_and_a_string_input_is_a_user_message() {
    let out = chat(json!({"model": "m", "instructions": "Be brief.", "input": "Hi\n\"there\"",
        "max_output_tokens": 7, "stream": true, "cache_salt": "s", "reasoning": {"effort": "low"},
        "temperature": 0.2, "priority": -2}));
    assert_eq!(
        out,
        json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\n\"there\""}],
            "model": "m", "stream": true, "max_tokens": 7, "cache_salt": "s", "priority": -2, "reasoning_effort": "low",
            "add_special_tokens": true})
    );
    let empty = chat(json!({"model": "m", "instructions": "", "input": "x"}));
    assert_eq!(empty["messages"], json!([{"role": "user", "content": "x"}]), "an empty instruction is none");
}

#[test]
fn items_become_messages_as_vllm_builds_them() {
    let out = chat(json!({"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}], "type": "message"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "S"}],
            "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"city\":\"Oslo\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "It rains.", "annotations": []}]},
        {"role": "developer", "content": "dev"},
    ]}));
    assert_eq!(
        out["messages"],
        json!([
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}], "type": "message"},
            {"role": "assistant", "reasoning": "think", "tool_calls": [
                {"id": "c1", "function": {"name": "get", "arguments": "{\"city\":\"Oslo\"}"}, "type": "function"},
                {"id": "c2", "function": {"name": "get", "arguments": "{}"}, "type": "function"}]},
            {"role": "tool", "content": "rain", "tool_call_id": "c1"},
            {"role": "assistant", "content": "It rains."},
            {"role": "developer", "content": "dev"},
        ])
    );
    assert!(out.get("add_generation_prompt").is_none());
}

#[test]
fn assistant_text_fills_an_assistant_turn_that_has_none() {
    let out = chat(json!({"model": "m", "input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"role": "assistant", "content": "after the call"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "second"}, {"type": "output_text", "text": "dropped"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "from the summary"}]},
    ]}));
    assert_eq!(
        out["messages"],
        json!([
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}, "type": "function"}],
                "content": "after the call"},
            {"role": "assistant", "reasoning": "from the summary", "content": "second"},
        ])
    );
}

#[test]
fn a_partial_last_message_is_continued() {
    let out = chat(json!({"model": "m", "input": [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "status": "incomplete", "content": [{"type": "output_text", "text": "Half"}]},
    ]}));
    assert_eq!(out["continue_final_message"], json!(true));
    assert_eq!(out["add_generation_prompt"], json!(false));
    let done = chat(
        json!({"model": "m", "input": [{"role": "assistant", "status": "completed", "content": "Whole"}]}),
    );
    assert!(done.get("continue_final_message").is_none());
}

#[test]
fn what_is_not_reproduced_is_media_so_the_prompt_is_hashed_up_to_it() {
    let body = json!({"model": "m", "input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "encrypted_content": "gAAA", "summary": []},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "ns"},
    ]})
    .to_string();
    let converted = chat(serde_json::from_str(&body).unwrap());
    assert_eq!(
        converted["messages"][1]["tool_calls"][0]["function"]["name"], "ns__f",
        "named as vLLM flattens it"
    );
    let empty =
        chat(json!({"model": "m", "input": [{"type": "reasoning", "encrypted_content": "", "summary": []}]}));
    assert_eq!(empty["messages"][0], json!({"role": "assistant", "reasoning": ""}), "an empty one is none");
    let t = tokenization();
    let (endpoint, readable) = t.readable(Endpoint::Responses, body.as_bytes()).unwrap();
    assert_eq!(endpoint, Endpoint::ChatCompletions);
    let parsed = ChatRequest::parse(&readable).unwrap();
    let media: Vec<bool> = parsed.messages.iter().map(|m| m.media.is_some()).collect();
    assert_eq!(media, [false, true], "the encrypted reasoning's turn, which the call joins");
}

#[test]
fn tools_become_chat_functions() {
    let out = chat(json!({"model": "m", "input": "x", "tools": [
        {"type": "function", "name": "get", "description": "Get it.", "parameters": {"type": "object"}, "strict": true,
            "defer_loading": true},
        {"type": "web_search"},
        {"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "read"}, {"type": "other", "name": "no"}]},
        {"type": "custom", "name": "patch", "description": "Apply a patch."},
    ]}));
    assert_eq!(
        out["tools"],
        json!([
            {"type": "function", "function": {"name": "get", "description": "Get it.", "parameters": {"type": "object"}, "strict": true,
                "defer_loading": true}},
            {"type": "function", "function": {"name": "fs__read", "description": null, "parameters": null}},
            {"type": "function", "function": {"name": "patch", "description": "Apply a patch.", "parameters":
                {"type": "object", "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}},
                 "required": ["input"], "additionalProperties": false}}},
        ])
    );
}

#[test]
fn tools_none_of_which_the_model_sees_are_an_empty_list() {
    assert_eq!(
        chat(json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}))["tools"],
        json!([])
    );
    assert!(chat(json!({"model": "m", "input": "x", "tools": []})).get("tools").is_none());
    // However it is spaced.
    let spaced = Responses::read(br#"{"model": "m", "input": "x", "tools": [ ]}"#).unwrap();
    let body: Value = serde_json::from_slice(&spaced.chat_body(&[])).unwrap();
    assert!(body.get("tools").is_none(), "{body}");
    assert!(chat(json!({"model": "m", "input": "x"})).get("tools").is_none());
}

#[test]
fn custom_tool_calls_wrap_their_input_as_python_dumps_it() {
    let out = chat(json!({"model": "m", "input": [
        {"type": "custom_tool_call", "call_id": "c", "name": "patch", "input": "*** Begin\né"},
        {"type": "custom_tool_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "ok"}]},
    ]}));
    assert_eq!(
        out["messages"][0]["tool_calls"][0]["function"]["arguments"],
        json!("{\"input\": \"*** Begin\\né\"}")
    );
    assert_eq!(
        out["messages"][1],
        json!({"role": "tool", "content": [{"type": "input_text", "text": "ok"}], "tool_call_id": "c"})
    );
}

#[test]
fn history_goes_between_the_instructions_and_the_input() {
    let body =
        json!({"model": "m", "instructions": "New rules.", "input": "next", "previous_response_id": "resp_1"}).to_string();
    let request = Responses::read(body.as_bytes()).unwrap();
    assert_eq!(request.previous_response_id.as_deref(), Some("resp_1"));
    let earlier: Vec<Box<RawValue>> =
        [r#"{"role":"user","content":"first"}"#, r#"{"role":"assistant","content":"answer"}"#]
            .iter()
            .map(|s| RawValue::from_string((*s).to_owned()).unwrap())
            .collect();
    let history: Vec<&RawValue> = earlier.iter().map(|b| &**b).collect();
    let out: Value = serde_json::from_slice(&request.chat_body(&history)).unwrap();
    assert_eq!(
        out["messages"],
        json!([{"role": "system", "content": "New rules."}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "answer"}, {"role": "user", "content": "next"}])
    );

    let refused = tokenization().readable(Endpoint::Responses, body.as_bytes()).map(|_| ());
    assert!(matches!(refused, Err(RequestError::StoredConversation)));
}

#[test]
fn malformed_requests_name_the_field() {
    let err = |body: Value| Responses::read(body.to_string().as_bytes()).unwrap_err().to_openai().param;
    assert_eq!(err(json!({"model": "m"})).as_deref(), Some("input"));
    assert_eq!(err(json!({"model": "m", "input": 3})).as_deref(), Some("input"));
    assert_eq!(err(json!({"model": "m", "input": "x", "instructions": 1})).as_deref(), Some("instructions"));
    assert_eq!(
        err(json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]})).as_deref(),
        Some("input[0].type")
    );
    let no_id = json!({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]});
    assert_eq!(err(no_id).as_deref(), Some("input[0].call_id"));
    assert_eq!(err(json!({"model": "m", "input": [7]})).as_deref(), Some("input[0]"));
    assert_eq!(
        err(json!({"model": "m", "input": "x", "tools": [{"type": "function"}]})).as_deref(),
        Some("tools[0].name")
    );
    assert!(matches!(Responses::read(b"[1]"), Err(RequestError::NotAnObject)));
}

/// For gpt-oss, vLLM keeps a Responses request's tools whatever its `tool_choice` (its
/// Harmony path never reads it), so the chat request made of it does not carry "none" for
/// `--exclude-tools-when-tool-choice-none` to act on.
#[test]
fn for_harmony_tool_choice_none_leaves_the_tools() {
    let body = json!({"model": "m", "input": "x", "tool_choice": "none",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]})
    .to_string();
    let read = |harmony| -> Value {
        let request = Responses::read_as(body.as_bytes(), harmony).unwrap();
        serde_json::from_slice(&request.chat_body(&[])).unwrap()
    };
    assert_eq!(read(false)["tool_choice"], "none");
    let harmony = read(true);
    assert_eq!(harmony.get("tool_choice"), None);
    assert_eq!(harmony["tools"][0]["function"]["name"], "f");
}

/// `store` and `background` as vLLM reads them: an absent `store` is true, a `null` one false
/// (`if request.store`); `background` is false unless true.
#[test]
fn store_and_background_are_read_as_vllm_reads_them() {
    use super::{asks_to_store, runs_in_background};
    let cases: [(&str, bool, bool); 5] = [
        (r#"{"input":"x"}"#, true, false),
        (r#"{"store":null,"background":null}"#, false, false),
        (r#"{"store":false,"background":true}"#, false, true),
        (r#"{"store":true,"background":false}"#, true, false),
        (r#"{"background":true}"#, true, true),
    ];
    for (body, store, background) in cases {
        assert_eq!(asks_to_store(body.as_bytes()).ok(), Some(store), "{body}");
        assert_eq!(runs_in_background(body.as_bytes()).ok(), Some(background), "{body}");
    }
    // As pydantic reads a boolean, and Python's json a repeated key.
    for (body, background) in [
        (r#"{"background":1}"#, true),
        (r#"{"background":"yes"}"#, true),
        (r#"{"background":"off"}"#, false),
        (r#"{"background":false,"background":true}"#, true),
    ] {
        assert_eq!(runs_in_background(body.as_bytes()).ok(), Some(background), "{body}");
    }
    assert!(runs_in_background(br#"{"background":"later"}"#).is_err());
}
