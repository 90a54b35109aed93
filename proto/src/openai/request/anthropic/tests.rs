use serde_json::{Value, json};

use super::{InlineSystem, chat_body};
use crate::openai::request::ChatRequest;
use crate::openai::{ChatTemplate, MessageProblem, RequestError};

/// The chat request made of the Messages request `body`.
fn chat(body: Value) -> Value {
    serde_json::from_slice(&preserve(body.to_string().as_bytes()).unwrap()).unwrap()
}

fn error(body: Value) -> RequestError {
    preserve(body.to_string().as_bytes()).unwrap_err()
}

#[test]
fn the_system_prompt_comes_first_without_the_billing_header_and_with_leading_system_messages() {
    let out = chat(json!({
        "model": "m", "max_tokens": 8, "stream": true, "cache_salt": "tenant",
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
            {"type": "text", "text": "You are "},
            {"type": "text", "text": ""},
            {"type": "text", "text": "helpful."}
        ],
        "messages": [
            {"role": "system", "content": "Project rules."},
            {"role": "system", "content": [{"type": "text", "text": "More rules."}]},
            {"role": "user", "content": "hi"}
        ],
        "temperature": 0.2, "stop_sequences": ["\n"]
    }));
    assert_eq!(
        out,
        json!({
            "model": "m", "max_tokens": 8, "stream": true, "cache_salt": "tenant",
            "messages": [
                {"role": "system", "content": "You are helpful.\n\nProject rules.\n\nMore rules."},
                {"role": "user", "content": "hi"}
            ]
        })
    );
    // A string system prompt is taken as it is, header or not.
    let out = chat(
        json!({"max_tokens": 1, "system": "x-anthropic-billing-header: a", "messages": [{"role": "user", "content": "q"}]}),
    );
    assert_eq!(out["messages"][0], json!({"role": "system", "content": "x-anthropic-billing-header: a"}));
}

#[test]
fn tool_use_and_tool_results_become_tool_calls_and_tool_messages_in_vllms_order() {
    let out = chat(json!({
        "max_tokens": 1,
        "messages": [
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should ", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "thinking", "thinking": "call ls."},
                {"type": "text", "text": "Calling ls."},
                {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "/", "all": true}}
            ]},
            {"role": "user", "content": [
                {"type": "text", "text": "A"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "bin"}, {"type": "text", "text": "etc"}
                ]},
                {"type": "text", "text": "B"}
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "done"}]},
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "odd"}]}
        ]
    }));
    assert_eq!(
        out["messages"],
        json!([
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": "Calling ls.", "reasoning": "I should call ls.",
             "tool_calls": [{"id": "toolu_1", "type": "function",
                             "function": {"name": "ls", "arguments": "{\"path\":\"/\",\"all\":true}"}}]},
            {"role": "tool", "content": "bin\netc", "tool_call_id": "toolu_1"},
            {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
            {"role": "tool", "content": "done", "tool_call_id": "toolu_2"},
            {"role": "assistant", "content": "Tool result: odd"}
        ])
    );
}

#[test]
fn images_become_image_url_parts_that_the_chat_parser_takes_for_media() {
    let body = json!({"max_tokens": 1, "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
            {"type": "text", "text": "what is this?"}
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://img"}}
        ]}]}
    ]});
    let out = chat(body.clone());
    assert_eq!(
        out["messages"][0]["content"][0],
        json!({"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}})
    );
    assert_eq!(out["messages"][1], json!({"role": "tool", "content": "", "tool_call_id": "t"}));
    assert_eq!(
        out["messages"][2],
        json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://img"}}]})
    );
    let converted = preserve(body.to_string().as_bytes()).unwrap();
    let parsed = ChatRequest::parse(&converted).unwrap();
    assert_eq!(parsed.first_media(), Some((0, "image_url")));
}

#[test]
fn tools_become_openai_functions_with_an_object_schema() {
    let out = chat(json!({"max_tokens": 1, "messages": [{"role": "user", "content": "q"}], "tools": [
        {"name": "ls", "description": "List.", "input_schema": {"properties": {"b": {}, "a": {}}}},
        {"name": "pwd", "input_schema": {}, "strict": true},
        {"name": "cat", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    ]}));
    // Key order as vLLM's dicts keep it: the schema's own keys, then the added type.
    let tools = serde_json::to_string(&out["tools"]).unwrap();
    let ls = r#"[{"type":"function","function":{"name":"ls","description":"List.","parameters":{"properties":{"b":{},"a":{}},"type":"object"}}}"#;
    assert!(tools.starts_with(ls), "{tools}");
    assert_eq!(
        out["tools"][1]["function"],
        json!({"name": "pwd", "description": null, "parameters": {"type": "object"}, "strict": true})
    );
    assert_eq!(out["tools"][2]["function"]["parameters"], json!({"type": "object"}));
}

#[test]
fn inline_system_messages_stay_in_place_after_the_tool_results_they_interrupt() {
    let out = chat(json!({"max_tokens": 1, "system": "S", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "system", "content": "reminder"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]},
        {"role": "system", "content": "x-anthropic-billing-header: z"}
    ]}));
    let roles: Vec<&str> =
        out["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "system"]);
    assert_eq!(out["messages"][4]["content"], "reminder");
}

#[test]
fn without_a_system_prompt_inline_system_messages_fold_into_user_turns() {
    let out = chat(json!({"max_tokens": 1, "messages": [
        {"role": "user", "content": "q"},
        {"role": "system", "content": "after q"},
        {"role": "assistant", "content": "a"},
        {"role": "system", "content": "before next"},
        {"role": "user", "content": [{"type": "text", "text": "next"}]},
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": "trailing"}
    ]}));
    assert_eq!(
        out["messages"],
        json!([
            {"role": "user", "content": "q\n\nafter q"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "before next\n\nnext"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "trailing"}
        ])
    );
    // Into the last tool result when the user turn has only tool results.
    let out = chat(json!({"max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]}]},
        {"role": "system", "content": "note"}
    ]}));
    assert_eq!(out["messages"], json!([{"role": "tool", "content": "r\n\nnote", "tool_call_id": "t"}]));
}

#[test]
fn effort_and_disabled_thinking_become_reasoning_effort() {
    let base = || json!({"max_tokens": 1, "messages": [{"role": "user", "content": "q"}]});
    let with = |key: &str, value: Value| {
        let mut body = base();
        body[key] = value;
        chat(body)
    };
    assert_eq!(with("output_config", json!({"effort": "high"}))["reasoning_effort"], "high");
    let mut both = base();
    both["output_config"] = json!({"effort": "high"});
    both["thinking"] = json!({"type": "disabled"});
    assert_eq!(chat(both)["reasoning_effort"], "none");
    assert_eq!(
        with("thinking", json!({"type": "enabled", "budget_tokens": 1024})).get("reasoning_effort"),
        None
    );
}

#[test]
fn malformed_requests_name_the_field_at_fault() {
    let user = json!([{"role": "user", "content": "q"}]);
    assert!(matches!(error(json!({"messages": user})), RequestError::MissingField { param: "max_tokens" }));
    assert!(matches!(error(json!({"max_tokens": 1})), RequestError::MissingField { param: "messages" }));
    assert!(matches!(
        error(json!({"max_tokens": 1, "messages": {}})),
        RequestError::InvalidField { param: "messages", .. }
    ));
    assert!(matches!(error(json!({"max_tokens": 1, "messages": []})), RequestError::EmptyMessages));
    assert!(matches!(
        error(json!({"max_tokens": 1, "messages": [1]})),
        RequestError::InvalidMessage { index: 0, problem: MessageProblem::NotAnObject }
    ));
    let at = |body: Value| match error(body) {
        RequestError::InvalidAt { at, .. } => at,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        at(json!({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]})),
        "messages[0].role"
    );
    assert_eq!(at(json!({"max_tokens": 1, "messages": [{"role": "user"}]})), "messages[0].content");
    // Claude Code's `ctx` and `msg` turns are the user's, as vLLM reads them.
    for role in ["ctx", "msg"] {
        let out = chat(json!({"max_tokens": 1, "messages": [{"role": role, "content": "x"}]}));
        assert_eq!(out["messages"], json!([{"role": "user", "content": "x"}]), "{role}");
    }
    assert_eq!(
        at(
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]})
        ),
        "messages[0].content[0].text"
    );
    assert_eq!(
        at(
            json!({"max_tokens": 1, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": [1]}]}]})
        ),
        "messages[0].content[0].input"
    );
    assert_eq!(
        at(json!({"max_tokens": 1, "messages": user, "tools": [{"name": "f"}]})),
        "tools[0].input_schema"
    );
    assert!(matches!(
        error(json!({"max_tokens": 1, "messages": user, "system": 5})),
        RequestError::InvalidField { param: "system", .. }
    ));
    assert!(matches!(preserve(b"[1]"), Err(RequestError::NotAnObject)));
    assert!(matches!(preserve(b"{"), Err(RequestError::Json(_))));
}

/// What the template renders of a Messages request is what it renders of the chat request
/// written by hand.
#[test]
fn a_messages_request_renders_as_the_chat_request_it_stands_for() {
    let converted = preserve(
        json!({"model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Bye"}
        ]})
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let by_hand = json!({"model": "m", "max_tokens": 4, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\nthere"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye"}
    ]})
    .to_string();
    let template = ChatTemplate::builtin_default();
    let render = |body: &[u8]| {
        let chat = ChatRequest::parse(body).unwrap();
        template.render(&chat.messages, chat.variables()).unwrap()
    };
    assert_eq!(render(&converted), render(by_hand.as_bytes()));
    assert_eq!(ChatRequest::parse(&converted).unwrap().max_tokens, Some(4));
}

fn preserve(body: &[u8]) -> Result<Vec<u8>, RequestError> {
    chat_body(body, InlineSystem::Preserve, false)
}

/// For gpt-oss, whose Harmony prompt writes a call's arguments as they are, a `tool_use`
/// input is written as vLLM's `json.dumps` writes it (a chat template parses it again).
#[test]
fn tool_use_input_for_harmony_is_written_as_json_dumps_writes_it() {
    let body = json!({"max_tokens": 1, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "ls", "input": {"path":"/é","all":true}},
            {"type": "tool_use", "id": "b", "name": "pwd", "input": {}}]}]});
    let arguments = |harmony| {
        let out: Value = serde_json::from_slice(
            &chat_body(body.to_string().as_bytes(), InlineSystem::Preserve, harmony).unwrap(),
        )
        .unwrap();
        let calls = out["messages"][1]["tool_calls"].as_array().unwrap().clone();
        calls.iter().map(|c| c["function"]["arguments"].as_str().unwrap().to_owned()).collect::<Vec<_>>()
    };
    assert_eq!(arguments(true), [r#"{"path": "/\u00e9", "all": true}"#, "{}"]);
    assert_eq!(arguments(false), [r#"{"path":"/é","all":true}"#, "{}"]);
}

#[test]
fn odd_tool_results_and_images_read_as_vllm_reads_them() {
    let out = chat(json!({"max_tokens": 1, "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {}},
            {"type": "text", "text": "no image above"},
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "tool_reference", "tool_name": "", "name": "grep"},
                {"type": "tool_reference", "tool_name": "glob"},
                {"type": "image"}
            ]}
        ]},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": []}]}
    ]}));
    assert_eq!(
        out["messages"],
        json!([
            {"role": "tool", "content": "", "tool_call_id": "t"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,"}}]},
            {"role": "tool", "content": [{"type": "tool_reference", "name": "grep"}, {"type": "tool_reference", "name": "glob"}],
                "tool_call_id": "t"},
            {"role": "user", "content": "no image above"},
            {"role": "assistant", "content": "Tool result: "}
        ])
    );
    let bad = error(
        json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}]}),
    );
    assert!(
        matches!(bad, RequestError::InvalidAt { ref at, .. } if at == "messages[0].content[0].source"),
        "{bad:?}"
    );
}

/// A template that refuses a system message after the first (as Qwen3.5's does) folds
/// inline system messages, as vLLM's probe decides for it; ChatML keeps them in place.
#[test]
fn the_template_probe_folds_where_a_system_turn_cannot_stand_mid_conversation() {
    use crate::openai::{SpecialTokens, inline_system_mode};
    let chatml = ChatTemplate::builtin_default();
    assert_eq!(inline_system_mode(&chatml), InlineSystem::Preserve);
    let refusing = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}\
                    {{ raise_exception('System message must be at the beginning.') }}{% endif %}\
                    <|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let dropping = "{% for m in messages %}{% if m.role != 'system' or loop.first %}<|{{ m.role }}|>{{ m.content }}\
                    {% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let as_user = "{% for m in messages %}<|{{ 'user' if m.role == 'system' and not loop.first else m.role }}|>\
                   {{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let unmarked = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ m.content }}\
                    {% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{% endfor %}";
    let marked = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    for (name, source, mode) in [
        ("refusing", refusing, InlineSystem::Fold),
        ("dropping", dropping, InlineSystem::Fold),
        ("as user", as_user, InlineSystem::Fold),
        ("unmarked", unmarked, InlineSystem::Fold),
        ("marked", marked, InlineSystem::Preserve),
    ] {
        let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
        assert_eq!(inline_system_mode(&template), mode, "{name}");
    }
    // Through a tokenization with the refusing template, a Claude Code turn is folded, not refused.
    let t = crate::openai::Tokenization::from_parts(
        Box::new(crate::openai::Builtin),
        Some(ChatTemplate::new(refusing, SpecialTokens::default()).unwrap()),
        "m",
        [],
    );
    let body = json!({"max_tokens": 1, "system": "S", "messages": [
        {"role": "user", "content": "q"}, {"role": "system", "content": "reminder"}]});
    let body = body.to_string();
    let (endpoint, readable) = t.readable(crate::openai::Endpoint::Messages, body.as_bytes()).unwrap();
    let request = crate::openai::ParsedRequest::parse(endpoint, &readable).unwrap();
    assert_eq!(
        t.render_chat(match &request {
            crate::openai::ParsedRequest::Chat(chat) => chat,
            _ => unreachable!(),
        })
        .unwrap(),
        "<|system|>S<|user|>q\n\nreminder<|assistant|>"
    );
}

/// Texts are joined as written, escapes and all, and read back as the texts they stand for.
#[test]
fn escaped_texts_join_into_the_texts_they_stand_for() {
    let body = r#"{"max_tokens":1,"system":[{"type":"text","text":"say \"hi\"\\"},{"type":"text","text":"\u00e9\n"}],
        "messages":[{"role":"system","content":"tab\there"},{"role":"user","content":[
            {"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"a\"b"},{"type":"text","text":""},{"type":"text","text":"\ud83d\ude00"}]}]},
            {"role":"assistant","content":[{"type":"thinking","thinking":"x\""},{"type":"thinking","thinking":"y"},
            {"type":"tool_result","tool_use_id":"t","content":"\"q\""}]}]}"#;
    let out: Value = serde_json::from_slice(&preserve(body.as_bytes()).unwrap()).unwrap();
    assert_eq!(
        out["messages"],
        json!([
            {"role": "system", "content": "say \"hi\"\\é\n\n\ntab\there"},
            {"role": "tool", "content": "a\"b\n\n😀", "tool_call_id": "t"},
            {"role": "assistant", "content": "Tool result: \"q\"", "reasoning": "x\"y"}
        ])
    );
}

/// A repeated key takes its last value, as Python's `json` reads it (the one-pass reading
/// refuses such a body, and the field-by-field one reads it).
#[test]
fn a_repeated_key_takes_its_last_value() {
    let body = br#"{"max_tokens":1,"max_tokens":2,"messages":[{"role":"user","content":"a","content":[
        {"type":"text","text":"x","text":"y"}]}]}"#;
    let out: Value = serde_json::from_slice(&preserve(body).unwrap()).unwrap();
    assert_eq!(out["max_tokens"], 2);
    assert_eq!(out["messages"], json!([{"role": "user", "content": "y"}]));
}

/// Arrays are not objects: neither a message nor a block may be one (a derived reading
/// would take one positionally).
#[test]
fn arrays_are_not_messages_or_blocks() {
    assert!(matches!(
        preserve(br#"{"max_tokens":1,"messages":[["user","hi"]]}"#),
        Err(RequestError::InvalidMessage { index: 0, problem: MessageProblem::NotAnObject })
    ));
    assert!(matches!(
        preserve(br#"{"max_tokens":1,"messages":[{"role":"user","content":[["text","hi"]]}]}"#),
        Err(RequestError::InvalidAt { .. })
    ));
    assert!(matches!(preserve(br#"[null,[{"role":"user","content":"q"}]]"#), Err(RequestError::NotAnObject)));
}
