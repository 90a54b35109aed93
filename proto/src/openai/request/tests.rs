//! Parsing of every prompt and message shape, and of every malformed case.

use std::borrow::Cow;

use super::*;
use crate::openai::error::MessageProblem;

fn completion(body: &str) -> Result<CompletionRequest<'_>, RequestError> {
    CompletionRequest::parse(body.as_bytes())
}

fn chat(body: &str) -> Result<ChatRequest<'_>, RequestError> {
    ChatRequest::parse(body.as_bytes())
}

#[test]
fn endpoints_from_paths() {
    assert_eq!(Endpoint::from_path("/v1/completions"), Some(Endpoint::Completions));
    assert_eq!(Endpoint::from_path("/v1/chat/completions/"), Some(Endpoint::ChatCompletions));
    assert_eq!(Endpoint::from_path("/v1/embeddings"), None);
    assert_eq!(Endpoint::from_path("/v1/messages"), Some(Endpoint::Messages));
    assert_eq!(Endpoint::from_path("/v1/messages/count_tokens"), None);
}

#[test]
fn a_messages_body_is_read_as_the_chat_request_it_becomes() {
    let body = br#"{"model":"m","max_tokens":3,"system":"S","messages":[{"role":"user","content":"q"}]}"#;
    assert!(ParsedRequest::parse(Endpoint::Messages, body).is_err(), "not without conversion");
    let t = crate::openai::Tokenization::new(&Default::default()).unwrap();
    let (endpoint, readable) = t.readable(Endpoint::Messages, body).unwrap();
    assert_eq!(endpoint, Endpoint::ChatCompletions);
    let ParsedRequest::Chat(chat) = ParsedRequest::parse(endpoint, &readable).unwrap() else {
        panic!("a chat")
    };
    assert_eq!((chat.model.as_ref(), chat.messages.len(), chat.max_tokens), ("m", 2, Some(3)));
    let (endpoint, same) = t.readable(Endpoint::Completions, b"{}").unwrap();
    assert!(endpoint == Endpoint::Completions && matches!(same, Cow::Borrowed(b"{}")));
}

#[test]
fn every_prompt_shape() {
    let r = completion(r#"{"model":"m","prompt":"hello world"}"#).unwrap();
    assert_eq!(r.prompt, Prompt::Text("hello world".into()));
    assert!(matches!(r.prompt, Prompt::Text(Cow::Borrowed(_))), "unescaped text borrows");
    assert!(r.add_special_tokens);
    assert!(!r.stream);

    let r = completion(r#"{"model":"m","prompt":"a\nb"}"#).unwrap();
    assert_eq!(r.prompt, Prompt::Text("a\nb".into()));

    let r = completion(r#"{"model":"m","prompt":["a","b"]}"#).unwrap();
    assert_eq!(r.prompt, Prompt::TextBatch(vec!["a".into(), "b".into()]));
    assert_eq!(r.prompt.len(), 2);

    let r = completion(r#"{"model":"m","prompt":[1, 2, 4294967295]}"#).unwrap();
    assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, u32::MAX]));
    assert_eq!(r.prompt.inputs(), vec![PromptInput::Tokens(&[1, 2, u32::MAX])]);

    let r = completion("{\"model\":\"m\",\"prompt\":[ 7 ,\n0,\t 12\r]}").unwrap();
    assert_eq!(r.prompt, Prompt::Tokens(vec![7, 0, 12]), "whitespace around ids");

    let r = completion(r#"{"model":"m","prompt":[[1,2],[3]]}"#).unwrap();
    assert_eq!(r.prompt, Prompt::TokensBatch(vec![vec![1, 2], vec![3]]));
    assert_eq!(r.prompt.inputs(), vec![PromptInput::Tokens(&[1, 2]), PromptInput::Tokens(&[3])]);

    // An empty string is a valid prompt here; whether it tokenizes to anything is decided later.
    assert_eq!(completion(r#"{"model":"m","prompt":""}"#).unwrap().prompt, Prompt::Text("".into()));
}

#[test]
fn optional_fields_and_unknown_fields() {
    let body = r#"{"temperature":0.5,"model":"m","prompt":"p","stream":true,"max_tokens":7,
        "cache_salt":"tenant-1","add_special_tokens":false,"logit_bias":{"1":2},"n":null,
        "extra":[{"deep":[1,2,{"x":null}]}]}"#;
    let r = completion(body).unwrap();
    assert!(r.stream);
    assert_eq!(r.max_tokens, Some(7));
    assert_eq!(r.cache_salt.as_deref(), Some("tenant-1"));
    assert!(!r.add_special_tokens);

    let r = completion(r#"{"model":"m","prompt":"p","max_tokens":null,"stream":null,"cache_salt":null}"#)
        .unwrap();
    assert_eq!((r.max_tokens, r.stream, r.cache_salt), (None, false, None));
}

/// Numbers and booleans are read as pydantic's default (lax) mode reads them, so as vLLM:
/// `256.0` (Python's `json.dumps` of a float) is 256, `"true"` is true.
#[test]
fn numbers_and_booleans_are_read_as_vllm_reads_them() {
    let body =
        r#"{"model":"m","prompt":[1.0,2e0,3],"max_tokens":256.0,"stream":"true","add_special_tokens":0}"#;
    let r = completion(body).unwrap();
    assert_eq!(
        (&r.prompt, r.max_tokens, r.stream, r.add_special_tokens),
        (&Prompt::Tokens(vec![1, 2, 3]), Some(256), true, false)
    );
    let r = completion(
        r#"{"model":"m","prompt":[[5.0],[6,true]],"max_tokens":" 17.00 ","stream":"Off","add_special_tokens":"yes"}"#,
    )
    .unwrap();
    assert_eq!(
        (&r.prompt, r.max_tokens, r.stream, r.add_special_tokens),
        (&Prompt::TokensBatch(vec![vec![5], vec![6, 1]]), Some(17), false, true)
    );
    assert_eq!(
        completion(r#"{"prompt":[false,2],"max_tokens":"8."}"#).unwrap().prompt,
        Prompt::Tokens(vec![0, 2])
    );
    assert_eq!(completion(r#"{"prompt":"p","max_tokens":"8."}"#).unwrap().max_tokens, Some(8));
    let r = chat(r#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":1e2,"add_generation_prompt":"n"}"#).unwrap();
    assert_eq!((r.max_completion_tokens, r.add_generation_prompt), (Some(100), false));
    // `priority` is any integer, 0 when absent or null.
    let priority = |body: &str| completion(body).unwrap().priority;
    assert_eq!(priority(r#"{"prompt":"p"}"#), 0);
    assert_eq!(priority(r#"{"prompt":"p","priority":null}"#), 0);
    assert_eq!(priority(r#"{"prompt":"p","priority":-3}"#), -3);
    assert_eq!(priority(r#"{"prompt":"p","priority":" -7.0 "}"#), -7);
    assert_eq!(priority(r#"{"prompt":"p","priority":2e0}"#), 2);
    let r = chat(r#"{"messages":[{"role":"user","content":"x"}],"priority":9}"#).unwrap();
    assert_eq!(r.priority, 9);
    for (body, param) in [
        (r#"{"prompt":"p","max_tokens":1.5}"#, "max_tokens"),
        (r#"{"prompt":"p","max_tokens":"ten"}"#, "max_tokens"),
        (r#"{"prompt":"p","max_tokens":"8.5"}"#, "max_tokens"),
        (r#"{"prompt":"p","max_tokens":-1.0}"#, "max_tokens"),
        (r#"{"prompt":"p","stream":"maybe"}"#, "stream"),
        (r#"{"prompt":"p","stream":2}"#, "stream"),
        (r#"{"prompt":"p","add_special_tokens":[]}"#, "add_special_tokens"),
        (r#"{"prompt":"p","priority":0.5}"#, "priority"),
        (r#"{"prompt":"p","priority":"high"}"#, "priority"),
        (r#"{"prompt":"p","priority":9223372036854775808}"#, "priority"),
    ] {
        match completion(body) {
            Err(RequestError::InvalidField { param: p, .. }) => assert_eq!(p, param, "{body}"),
            other => panic!("{body}: {other:?}"),
        }
    }
}

/// A repeated key's last value wins, as Python's `json.loads` (so vLLM) reads it: at the top
/// level, by either path, and in content parts.
#[test]
fn repeated_keys_take_their_last_value() {
    let body =
        r#"{"model":"m","model":"n","prompt":"p","prompt":[1,2],"stream":true,"prompt":"q","stream":null}"#;
    for fast in [true, false] {
        let r = CompletionRequest::parse_with(body.as_bytes(), fast).unwrap();
        assert_eq!(
            (r.model.as_ref(), &r.prompt, r.stream),
            ("n", &Prompt::Text("q".into()), false),
            "{fast}"
        );
    }
    let body = r#"{"pr\u006fmpt":"p","prompt":"q","model":"m"}"#;
    assert_eq!(completion(body).unwrap().prompt, Prompt::Text("q".into()));
    let chat_body = r#"{"messages":[{"role":"user","content":"x"}],"model":"m","messages":[{"role":"system","role":"user",
        "content":[{"type":"image_url","type":"text","text":"a","text":"b"},{"type":"text","type":"input_audio"}]}]}"#;
    let r = chat(chat_body).unwrap();
    assert_eq!((r.messages.len(), r.messages[0].role.as_ref()), (1, "user"));
    assert_eq!((r.messages[0].content.as_deref(), r.first_media()), (Some("b"), Some((0, "input_audio"))));
}

/// Whether an error is the expected one.
type Check = fn(&RequestError) -> bool;

/// A completion of embeddings alone has no token ids: what is read of it, its sequences
/// counted over a list of them. Beside a prompt (one batch in vLLM), the prompt is read.
#[test]
fn prompt_embeddings_are_read_for_routing_by_load() {
    let body = br#"{"model":"m","prompt_embeds":["AAAA","BBBB"],"n":3,"max_tokens":5,"priority":-2}"#;
    let Err(RequestError::PromptEmbeds(asked)) = CompletionRequest::parse(body) else {
        panic!("embeddings alone")
    };
    assert_eq!(
        (asked.model.as_str(), asked.max_tokens, asked.sequences, asked.priority),
        ("m", Some(5), 6, -2)
    );
    let both = CompletionRequest::parse(br#"{"model":"m","prompt":"p","prompt_embeds":"AAAA"}"#).unwrap();
    assert_eq!(both.prompt, Prompt::Text("p".into()));
}

#[test]
fn malformed_completions() {
    use RequestError as E;
    let cases: &[(&str, Check)] = &[
        (r#"{"model":"m","prompt":"p""#, |e| matches!(e, E::Json(_))),
        ("not json", |e| matches!(e, E::Json(_))),
        ("", |e| matches!(e, E::Json(_))),
        (r#"["m","p"]"#, |e| matches!(e, E::NotAnObject)),
        (r#" "text" "#, |e| matches!(e, E::NotAnObject)),
        (r#"{"model":3,"prompt":"p"}"#, |e| matches!(e, E::InvalidField { param: "model", .. })),
        (r#"{"model":"m"}"#, |e| matches!(e, E::MissingField { param: "prompt" })),
        (r#"{"model":"m","prompt":null}"#, |e| matches!(e, E::MissingField { param: "prompt" })),
        // Embeddings instead of a prompt (vLLM with `--enable-prompt-embeds`).
        (r#"{"model":"m","prompt_embeds":"AAAA"}"#, |e| matches!(e, E::PromptEmbeds(_))),
        (r#"{"model":"m","prompt_embeds":"AAAA","max_tokens":"many"}"#, |e| {
            matches!(e, E::InvalidField { param: "max_tokens", .. })
        }),
        (r#"{"model":"m","prompt_embeds":null}"#, |e| matches!(e, E::MissingField { param: "prompt" })),
        (r#"{"model":"m","prompt":[]}"#, |e| matches!(e, E::EmptyPrompt)),
        (r#"{"model":"m","prompt":[[1],[]]}"#, |e| matches!(e, E::EmptyPrompt)),
        (r#"{"model":"m","prompt":7}"#, |e| matches!(e, E::BadPromptType)),
        (r#"{"model":"m","prompt":{"text":"p"}}"#, |e| matches!(e, E::BadPromptType)),
        (r#"{"model":"m","prompt":true}"#, |e| matches!(e, E::BadPromptType)),
        (r#"{"model":"m","prompt":["a",1]}"#, |e| matches!(e, E::BadPromptType)),
        (r#"{"model":"m","prompt":[1,"a"]}"#, |e| matches!(e, E::BadPromptType)),
        (r#"{"model":"m","prompt":[[1],2]}"#, |e| matches!(e, E::BadPromptType)),
        (r#"{"model":"m","prompt":[[1,"a"]]}"#, |e| matches!(e, E::BadPromptType)),
        (r#"{"model":"m","prompt":[[[1]]]}"#, |e| matches!(e, E::BadPromptType)),
        (r#"{"model":"m","prompt":[null]}"#, |e| matches!(e, E::BadPromptType)),
        (r#"{"model":"m","prompt":[1,-1]}"#, |e| matches!(e, E::BadTokenId)),
        (r#"{"model":"m","prompt":[4294967296]}"#, |e| matches!(e, E::BadTokenId)),
        (r#"{"model":"m","prompt":[1.5]}"#, |e| matches!(e, E::BadTokenId)),
        (r#"{"model":"m","prompt":[[1,-2]]}"#, |e| matches!(e, E::BadTokenId)),
        (r#"{"model":"m","prompt":"p","stream":"sure"}"#, |e| {
            matches!(e, E::InvalidField { param: "stream", .. })
        }),
        (r#"{"model":"m","prompt":"p","max_tokens":-1}"#, |e| {
            matches!(e, E::InvalidField { param: "max_tokens", .. })
        }),
        (r#"{"model":"m","prompt":"p","cache_salt":""}"#, |e| {
            matches!(e, E::InvalidField { param: "cache_salt", .. })
        }),
        (r#"{"model":"m","prompt":"p","cache_salt":5}"#, |e| {
            matches!(e, E::InvalidField { param: "cache_salt", .. })
        }),
    ];
    for (body, check) in cases {
        match completion(body) {
            Ok(r) => panic!("{body:?} parsed: {r:?}"),
            Err(e) => assert!(check(&e), "{body:?} gave {e:?}"),
        }
    }
}

#[test]
fn chat_messages_and_fields() {
    let body = r#"{"model":"m","messages":[
        {"role":"system","content":"be brief"},
        {"role":"user","content":[{"type":"text","text":"part one"},{"type":"text","text":"part two"}],"name":"bob"},
        {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function"}]},
        {"role":"tool","content":[{"type":"text","text":"only"}],"tool_call_id":"c1"}
      ],"max_tokens":5,"max_completion_tokens":9,"cache_salt":"s","chat_template_kwargs":{"enable_thinking":false},
      "tools":[{"type":"function"}]}"#;
    let r = chat(body).unwrap();
    assert_eq!(r.messages.len(), 4);
    assert_eq!(r.messages[0].role, "system");
    assert_eq!(r.messages[0].content.as_deref(), Some("be brief"));
    assert_eq!(r.messages[1].content.as_deref(), Some("part one\npart two"));
    assert_eq!(r.messages[1].extra.len(), 1);
    assert_eq!(r.messages[1].extra[0].0, "name");
    assert_eq!(r.messages[1].extra[0].1.get(), r#""bob""#);
    assert_eq!(r.messages[2].content, None);
    assert_eq!(r.messages[2].extra[0].0, "tool_calls");
    assert_eq!(r.messages[3].content.as_deref(), Some("only"));
    assert!(r.add_generation_prompt);
    assert!(!r.add_special_tokens);
    assert_eq!(r.chat_template_kwargs.map(|k| k.get()), Some(r#"{"enable_thinking":false}"#));

    let parsed = ParsedRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
    assert_eq!(parsed.max_tokens(), Some(9), "max_completion_tokens wins");
    // vLLM takes `max_completion_tokens or max_tokens`: a 0 is passed over, as Python's `or` does.
    for (limits, expected) in [
        (r#""max_completion_tokens":0,"max_tokens":32"#, Some(32)),
        (r#""max_completion_tokens":0"#, None),
        (r#""max_completion_tokens":5,"max_tokens":32"#, Some(5)),
    ] {
        let body = format!(r#"{{"messages":[{{"role":"user","content":"x"}}],{limits}}}"#);
        let parsed = ParsedRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
        assert_eq!(parsed.max_tokens(), expected, "{limits}");
    }
    assert_eq!(parsed.cache_salt(), Some("s"));
    assert_eq!(parsed.model(), "m");

    let r =
        chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}"#)
            .unwrap();
    assert!(!r.add_generation_prompt);
    assert!(r.messages[0].extra.is_empty());
}

#[test]
fn whitespace_around_values_is_fine() {
    let body = "\n { \"model\" : \"m\" ,\t\"messages\" : [ { \"role\" : \"user\" , \"content\" : [ { \"type\" : \"text\" , \"text\" : \"hi\" } ] } ] ,
        \"chat_template_kwargs\" : { \"a\" : 1 } , \"tools\" : [ ] , \"max_tokens\" : 3 } \n";
    let r = chat(body).unwrap();
    assert_eq!(r.messages[0].content.as_deref(), Some("hi"));
    assert!(r.chat_template_kwargs.is_some() && r.tools.is_some());
    assert_eq!(r.max_tokens, Some(3));
    let r = completion("{ \"model\" : \"m\" , \"prompt\" : [ [ 1 , 2 ] ] }").unwrap();
    assert_eq!(r.prompt, Prompt::TokensBatch(vec![vec![1, 2]]));
}

#[test]
fn malformed_chats() {
    use MessageProblem as P;
    use RequestError as E;
    let msg = |m: &str| format!(r#"{{"model":"m","messages":[{{"role":"user","content":"ok"}},{m}]}}"#);
    let bad_message = |body: String, want: P| match chat(&body) {
        Err(E::InvalidMessage { index: 1, problem }) => assert_eq!(problem, want, "{body}"),
        other => panic!("{body}: {other:?}"),
    };
    bad_message(msg(r#""hello""#), P::NotAnObject);
    bad_message(msg(r#"[1]"#), P::NotAnObject);
    bad_message(msg(r#"{"content":"x"}"#), P::MissingRole);
    bad_message(msg(r#"{"role":null,"content":"x"}"#), P::MissingRole);
    bad_message(msg(r#"{"role":1,"content":"x"}"#), P::BadRole);
    bad_message(msg(r#"{"role":"user","content":5}"#), P::BadContent);
    bad_message(msg(r#"{"role":"user","content":{"type":"text"}}"#), P::BadContent);
    bad_message(msg(r#"{"role":"user","content":[5]}"#), P::BadContentPart);
    bad_message(msg(r#"{"role":"user","content":[{"text":"x"}]}"#), P::BadContentPart);
    bad_message(msg(r#"{"role":"user","content":[{"type":"text","text":3}]}"#), P::BadContentPart);

    // vLLM reads plain strings, and these part types from their own keys, as text.
    // One whose value is missing, null or empty is skipped.
    let parts = r#"{"role":"assistant","content":["a","",{"type":"input_text","text":"b"},{"type":"output_text","text":"c"},
        {"type":"refusal","refusal":"d"},{"type":"thinking","thinking":"e"},{"type":"text"},{"type":"text","text":null},
        {"type":"refusal","text":"no"},{"type":"text","text":""}]}"#;
    let body = msg(parts);
    let r = chat(&body).unwrap();
    assert_eq!(r.messages[1].content.as_deref(), Some("a\nb\nc\nd\ne"));

    // Other parts (media) are left out of the text; the first one's type is kept.
    let media = msg(r#"{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}},"a",
        {"type":"input_audio","input_audio":{}},{"type":"text","text":"b"}]}"#);
    let r = chat(&media).unwrap();
    assert_eq!(r.messages[1].content.as_deref(), Some("a\nb"));
    assert_eq!(r.messages[1].media.as_deref(), Some("image_url"));
    assert_eq!((r.messages[0].media.as_deref(), r.first_media()), (None, Some((1, "image_url"))));
    assert_eq!(chat(&body).unwrap().first_media(), None);
    assert!(matches!(chat(r#"{"model":"m","messages":[]}"#), Err(E::EmptyMessages)));
    assert!(matches!(chat(r#"{"model":"m"}"#), Err(E::MissingField { param: "messages" })));
    assert!(matches!(
        chat(r#"{"model":"m","messages":"hi"}"#),
        Err(E::InvalidField { param: "messages", .. })
    ));
    // `model` is optional, as in vLLM: none is the base model.
    for body in [
        r#"{"messages":[{"role":"user","content":"x"}]}"#,
        r#"{"model":null,"messages":[{"role":"user","content":"x"}]}"#,
    ] {
        assert_eq!(
            ParsedRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap().model(),
            "",
            "{body}"
        );
    }
    assert_eq!(ParsedRequest::parse(Endpoint::Completions, br#"{"prompt":"p"}"#).unwrap().model(), "");
    assert!(matches!(
        chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"chat_template_kwargs":[1]}"#),
        Err(E::InvalidField { param: "chat_template_kwargs", .. })
    ));
    assert!(matches!(
        chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":{}}"#),
        Err(E::InvalidField { param: "tools", .. })
    ));
    assert!(matches!(
        chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"add_generation_prompt":2}"#),
        Err(E::InvalidField { param: "add_generation_prompt", .. })
    ));
}

mod fast_path {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;

    /// Both paths' outcome, comparable: the request's debug form or the error's message.
    fn outcome<T: std::fmt::Debug>(r: Result<T, RequestError>) -> String {
        match r {
            Ok(v) => format!("ok {v:?}"),
            Err(e) => format!("error {e}"),
        }
    }

    fn value() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            (0u64..70_000).prop_map(Value::from),
            Just(json!(-3)),
            Just(json!(2.5)),
            "[a-z é\"\\\\\n]{0,6}".prop_map(Value::from),
            prop::collection::vec(0u32..200_000, 0..12).prop_map(|v| json!(v)),
            prop::collection::vec(prop_oneof![(0u32..9).prop_map(Value::from), Just(json!("x"))], 0..4)
                .prop_map(Value::Array),
            Just(json!([[1, 2], [3]])),
            Just(json!({"role": "user", "content": "hi"})),
            Just(json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}])),
        ]
    }

    fn key() -> impl Strategy<Value = String> {
        prop::sample::select(vec![
            "model",
            "prompt",
            "messages",
            "stream",
            "max_tokens",
            "max_completion_tokens",
            "cache_salt",
            "add_special_tokens",
            "add_generation_prompt",
            "chat_template_kwargs",
            "tools",
            "priority",
            "temperature",
            "x\u{e9}",
            "",
        ])
        .prop_map(str::to_owned)
    }

    /// A body: members written out by hand (so keys can repeat), with whitespace choices,
    /// then possibly damaged.
    fn body() -> impl Strategy<Value = String> {
        let member = (key(), value(), any::<bool>());
        (
            prop::collection::vec(member, 0..7),
            any::<bool>(),
            prop::option::of((any::<prop::sample::Index>(), 0u8..5)),
        )
            .prop_map(|(members, spaced, damage)| {
                let sep = if spaced { ", " } else { "," };
                let items: Vec<String> = members
                    .iter()
                    .map(|(k, v, escaped)| {
                        let k = if *escaped && k == "prompt" { "pr\\u006fmpt".to_owned() } else { k.clone() };
                        if spaced { format!("\"{k}\" : {v}") } else { format!("\"{k}\":{v}") }
                    })
                    .collect();
                let mut body = format!("{{{}}}", items.join(sep));
                if let Some((at, how)) = damage {
                    let i = at.index(body.len() + 1);
                    let i = (0..=i).rev().find(|&i| body.is_char_boundary(i)).unwrap_or(0);
                    match how {
                        0 => body.truncate(i),
                        1 => body.insert(i, ','),
                        2 => body.insert(i, '0'),
                        3 => body.insert_str(i, " \n"),
                        _ => body.push_str(" x"),
                    }
                }
                body
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn fast_and_serde_paths_agree(body in body()) {
            let bytes = body.as_bytes();
            prop_assert_eq!(
                outcome(CompletionRequest::parse_with(bytes, true)),
                outcome(CompletionRequest::parse_with(bytes, false)),
                "completion {}", body
            );
            prop_assert_eq!(
                outcome(ChatRequest::parse_with(bytes, true)),
                outcome(ChatRequest::parse_with(bytes, false)),
                "chat {}", body
            );
        }
    }

    /// Strings the fast path must not take as they are: raw control characters and bytes
    /// that are not UTF-8 are errors, escapes are decoded; both paths say the same.
    #[test]
    fn prompt_strings_only_serde_can_read() {
        let bodies: [&[u8]; 4] = [
            b"{\"model\":\"m\",\"prompt\":\"a\tb\"}",
            b"{\"model\":\"m\",\"prompt\":\"a\xffb\"}",
            b"{\"model\":\"m\",\"prompt\":\"a\\\"b\\u00e9\"}",
            b"{\"model\":\"m\",\"prompt\":\"caf\xc3\xa9 \x7f\"}",
        ];
        for body in bodies {
            let fast = CompletionRequest::parse_with(body, true);
            assert_eq!(outcome(fast), outcome(CompletionRequest::parse_with(body, false)));
        }
        assert!(CompletionRequest::parse_with(bodies[0], true).is_err());
        assert!(CompletionRequest::parse_with(bodies[1], true).is_err());
        assert!(format!("{:?}", CompletionRequest::parse_with(bodies[2], true)).contains("a\\\"bé"));
    }

    #[test]
    fn the_fast_path_takes_the_usual_bodies() {
        let ids = serde_json::to_string(&(0..5000).collect::<Vec<u32>>()).unwrap();
        let body = format!(r#"{{"model": "m", "prompt": {ids}, "max_tokens": 16, "temperature": 0.7}}"#);
        let fields = scan::fields(body.as_bytes(), &CompletionRequest::FIELDS, Some(1)).expect("fast path");
        assert!(matches!(&fields[1], Some(scan::Field::Ids(v)) if v.iter().copied().eq(0..5000)));
        let body = r#"{"model":"m","prompt":"hello","stream":true,"cache_salt":null}"#;
        let fields = scan::fields(body.as_bytes(), &CompletionRequest::FIELDS, Some(1)).expect("fast path");
        assert!(matches!(&fields[1], Some(scan::Field::Text(t)) if t == "hello"));
        assert!(fields[4].is_none(), "null is absent");
        let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[]}"#;
        assert!(scan::fields(chat.as_bytes(), &ChatRequest::FIELDS, None).is_some());
    }
}

/// vLLM's request check refuses `continue_final_message` with a generation prompt it was
/// sent; the default one is refused when a template renders (a Harmony chat ignores it).
#[test]
fn a_continued_final_message_needs_the_generation_prompt_off() {
    let last = r#""messages":[{"role":"assistant","content":"Sure"}]"#;
    let both = format!(r#"{{{last},"continue_final_message":1,"add_generation_prompt":true}}"#);
    let refused = chat(&both);
    assert!(matches!(refused, Err(RequestError::CannotContinue(_))), "{refused:?}");
    let continued = format!(r#"{{{last},"continue_final_message":true}}"#);
    let default = chat(&continued).unwrap();
    assert!(default.continue_final_message && default.add_generation_prompt);
    let body = format!(r#"{{{last},"continue_final_message":true,"add_generation_prompt":false}}"#);
    let r = chat(&body).unwrap();
    assert!(r.continue_final_message && !r.add_generation_prompt);
    assert!(!chat(&format!("{{{last}}}")).unwrap().continue_final_message);
    assert!(matches!(
        chat(&format!(r#"{{{last},"continue_final_message":"maybe"}}"#)),
        Err(RequestError::InvalidField { param: "continue_final_message", .. })
    ));
}

/// vLLM 0.33 drops Claude Code's attribution line from a system message's plain or `text`
/// parts (and a part that was nothing else), whatever API the request came through.
#[test]
fn a_system_messages_billing_header_line_is_left_out() {
    let header = "x-anthropic-billing-header: cc_version=2.1; cch=9f3a1;";
    let system = |content: serde_json::Value| {
        let body = serde_json::json!({"messages": [{"role": "system", "content": content},
            {"role": "user", "content": content}]});
        let body = body.to_string();
        let chat = ChatRequest::parse(body.as_bytes()).unwrap();
        let [system, user] = [&chat.messages[0], &chat.messages[1]].map(|m| {
            (
                m.content.as_deref().map(str::to_owned),
                m.parts.clone().map(|p| p.iter().map(Part::text).collect()),
            )
        });
        (system, user)
    };
    let (kept, user) = system(format!("{header}\nYou are Claude Code.").into());
    assert_eq!(kept, (Some("You are Claude Code.".into()), None));
    assert_eq!(user.0.as_deref(), Some(&*format!("{header}\nYou are Claude Code.")), "only a system turn's");
    let (nothing, _) = system(header.into());
    assert_eq!(nothing, (Some(String::new()), Some(String::new())), "no text left: no part");
    let parts = serde_json::json!([{"type": "text", "text": header}, "Be brief.",
        {"type": "input_text", "text": format!("{header}\nkept")}, {"type": "text", "text": format!("{header}\nx\ny")}]);
    let (kept, _) = system(parts);
    assert_eq!(
        kept.0.as_deref(),
        Some(&*format!("Be brief.\n{header}\nkept\nx\ny")),
        "only plain and text parts"
    );
}
