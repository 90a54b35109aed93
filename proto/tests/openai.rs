//! The `openai` feature end to end: fixtures on disk, requests in, token ids and block hashes
//! out. Expected ids and renderings come from Python (`tokenizers` 0.23.3, and jinja2 set up
//! as transformers' `apply_chat_template`), printed by `tests/data/make_tiny_tokenizer.py`.
#![cfg(feature = "openai")]

use std::path::PathBuf;

use kvroute_proto::CacheNamespace;
use kvroute_proto::openai::{
    Builtin, ChatOptions, ChatTemplate, ContentFormatOption, Endpoint, HuggingFace, LoadError, ParsedRequest,
    PrefixCache, RequestError, SpecialTokens, Tokenization, TokenizationConfig, Tokenizer, TokenizerSpec,
    Variables,
};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn hf_config() -> TokenizationConfig {
    TokenizationConfig {
        base_model: "tiny".into(),
        lora_adapters: vec!["tiny-sql".into()],
        tokenizer: TokenizerSpec::HuggingFace { path: data("tiny-tokenizer.json") },
        tokenizer_config: Some(data("tiny-tokenizer_config.json")),
        chat_template: None,
        ..Default::default()
    }
}

fn builtin_config() -> TokenizationConfig {
    TokenizationConfig {
        base_model: "demo".into(),
        lora_adapters: vec!["demo-lora".into()],
        ..Default::default()
    }
}

fn tokens(t: &Tokenization, endpoint: Endpoint, body: &str) -> Result<Vec<Vec<u32>>, RequestError> {
    t.prompt_tokens(&ParsedRequest::parse(endpoint, body.as_bytes())?)
}

/// The conversation of `make_tiny_tokenizer.py`.
const CONVERSATION: &str = r#"[
    {"role": "system", "content": "  You are a helpful assistant.  "},
    {"role": "user", "content": "Hello, world!"},
    {"role": "assistant", "content": " Hello! How are you today?\n"},
    {"role": "user", "content": "What is the capital of France?"}]"#;

fn chat_body(extra: &str) -> String {
    format!(r#"{{"model":"tiny","messages":{CONVERSATION}{extra}}}"#)
}

const LLAMA_PREFIX_IDS: [u32; 71] = [
    0, 2, 87, 321, 307, 3, 203, 203, 366, 296, 264, 225, 262, 393, 384, 80, 347, 18, 4, 2, 89, 87, 269, 3,
    203, 203, 360, 291, 16, 326, 313, 392, 5, 4, 2, 69, 317, 345, 3, 203, 203, 360, 291, 5, 225, 361, 296,
    329, 272, 378, 35, 4, 2, 89, 87, 269, 3, 203, 203, 59, 338, 335, 265, 353, 300, 225, 359, 273, 286, 35,
    4,
];

#[test]
fn hf_fixture_encodes_like_python() {
    let tok = HuggingFace::from_file(data("tiny-tokenizer.json")).unwrap();
    assert_eq!(tok.vocab_size(), 400);
    let cases: &[(&str, &[u32])] = &[
        ("Hello, world!", &[360, 291, 16, 326, 313, 392, 5]),
        (
            "The quick brown fox jumps over the lazy dog.",
            &[
                302, 225, 275, 390, 282, 86, 314, 82, 283, 397, 225, 391, 292, 87, 276, 90, 269, 265, 323,
                371, 93, 225, 376, 75, 18,
            ],
        ),
        (
            "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
            &[2, 89, 87, 269, 3, 203, 203, 76, 77, 4],
        ),
        ("naïve 東京 42", &[82, 69, 132, 112, 90, 73, 225, 167, 256, 114, 165, 123, 110, 225, 24, 22]),
    ];
    for (text, ids) in cases {
        assert_eq!(tok.encode(text, false).unwrap(), *ids, "{text:?}");
        // The post-processor prepends <|begin_of_text|> (id 0).
        let with_bos: Vec<u32> = std::iter::once(0).chain(ids.iter().copied()).collect();
        assert_eq!(tok.encode(text, true).unwrap(), with_bos, "{text:?}");
    }
    let err = HuggingFace::from_bytes(b"{\"not\": \"a tokenizer\"}").unwrap_err();
    assert!(matches!(err, LoadError::Tokenizer { .. }));
}

#[test]
fn completions_follow_vllm() {
    let t = Tokenization::new(&hf_config()).unwrap();
    // Text prompts get BOS, unless the request turns special tokens off.
    assert_eq!(
        tokens(&t, Endpoint::Completions, r#"{"model":"tiny","prompt":"Hello, world!"}"#).unwrap(),
        [vec![0, 360, 291, 16, 326, 313, 392, 5]]
    );
    assert_eq!(
        tokens(
            &t,
            Endpoint::Completions,
            r#"{"model":"tiny","prompt":"Hello, world!","add_special_tokens":false}"#
        )
        .unwrap(),
        [vec![360, 291, 16, 326, 313, 392, 5]]
    );
    // An empty string still has its BOS.
    assert_eq!(tokens(&t, Endpoint::Completions, r#"{"model":"tiny","prompt":""}"#).unwrap(), [vec![0]]);
    // Batches give one list per prompt; token ids are used as they are.
    assert_eq!(
        tokens(&t, Endpoint::Completions, r#"{"model":"tiny","prompt":["Hello, world!", "Hello"]}"#).unwrap(),
        [vec![0, 360, 291, 16, 326, 313, 392, 5], vec![0, 360, 291]]
    );
    assert_eq!(
        tokens(&t, Endpoint::Completions, r#"{"model":"tiny","prompt":[5, 399, 0]}"#).unwrap(),
        [vec![5, 399, 0]]
    );
    assert_eq!(
        tokens(&t, Endpoint::Completions, r#"{"model":"tiny","prompt":[[1],[2,3]]}"#).unwrap(),
        [vec![1], vec![2, 3]]
    );
    assert!(matches!(
        tokens(&t, Endpoint::Completions, r#"{"model":"tiny","prompt":[[1],[2,400]]}"#),
        Err(RequestError::TokenIdOutOfRange { token_id: 400, vocab_size: 400 })
    ));

    // The builtin tokenizer has no BOS, so an empty text prompt is empty.
    let b = Tokenization::new(&builtin_config()).unwrap();
    assert!(matches!(
        tokens(&b, Endpoint::Completions, r#"{"model":"demo","prompt":""}"#),
        Err(RequestError::EmptyPrompt)
    ));
    assert!(matches!(
        tokens(&b, Endpoint::Completions, r#"{"model":"demo","prompt":[32768]}"#),
        Err(RequestError::TokenIdOutOfRange { token_id: 32768, vocab_size: 32768 })
    ));
    // Checked once truncated, as vLLM checks them: an id cut off is never read.
    assert_eq!(
        tokens(
            &b,
            Endpoint::Completions,
            r#"{"model":"demo","prompt":[40000,5,6,7],"truncate_prompt_tokens":3}"#
        )
        .unwrap(),
        [vec![5, 6, 7]]
    );
}

#[test]
fn default_template_renders_chatml() {
    let t = Tokenization::new(&builtin_config()).unwrap();
    let body = r#"{"model":"demo","messages":[
        {"role":"system","content":"You are terse."},
        {"role":"user","content":[{"type":"text","text":"Hi"},{"type":"text","text":"there"}]},
        {"role":"assistant","content":"Hello."},
        {"role":"assistant","content":null,"tool_calls":[]},
        {"role":"user","content":"Bye"}]}"#;
    let parsed = ParsedRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
    let ParsedRequest::Chat(chat) = &parsed else { unreachable!() };
    let want = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n\
                <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n\
                <|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(t.render_chat(chat).unwrap(), want);
    assert_eq!(t.prompt_tokens(&parsed).unwrap(), [Builtin.encode(want, false).unwrap()]);
    assert_eq!(t.prompt_tokens(&parsed).unwrap()[0][..2], [1, Builtin::piece_id("system")]);

    let no_gen = body.replace(r#""messages""#, r#""add_generation_prompt":false,"messages""#);
    let parsed = ParsedRequest::parse(Endpoint::ChatCompletions, no_gen.as_bytes()).unwrap();
    let ParsedRequest::Chat(chat) = &parsed else { unreachable!() };
    assert_eq!(t.render_chat(chat).unwrap(), want.strip_suffix("<|im_start|>assistant\n").unwrap());
}

#[test]
fn llama_style_template_matches_transformers() {
    let t = Tokenization::new(&hf_config()).unwrap();
    let special = t.chat_template().unwrap().special_tokens();
    assert_eq!(
        (special.get("bos_token"), special.get("eos_token")),
        (Some("<|begin_of_text|>"), Some("<|eot_id|>"))
    );

    let render = |extra: &str| {
        let body = chat_body(extra);
        let parsed = ParsedRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
        let ParsedRequest::Chat(chat) = &parsed else { unreachable!() };
        (t.render_chat(chat).unwrap(), t.prompt_tokens(&parsed).unwrap())
    };
    let jinja2 = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>\
        <|start_header_id|>user<|end_header_id|>\n\nHello, world!<|eot_id|>\
        <|start_header_id|>assistant<|end_header_id|>\n\nHello! How are you today?<|eot_id|>\
        <|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>";
    let header = "<|start_header_id|>assistant<|end_header_id|>\n\n";
    let header_ids = [2, 69, 317, 345, 3, 203, 203];

    // Chat encodes without special tokens: the BOS (id 0) comes from the template, once.
    let (text, ids) = render("");
    assert_eq!(text, format!("{jinja2}{header}"));
    assert_eq!(ids, [[&LLAMA_PREFIX_IDS[..], &header_ids].concat()]);

    let (text, ids) = render(r#","add_generation_prompt":false"#);
    assert_eq!(text, jinja2);
    assert_eq!(ids, [LLAMA_PREFIX_IDS.to_vec()]);

    let (text, ids) = render(r#","chat_template_kwargs":{"enable_thinking":false}"#);
    assert_eq!(text, format!("{jinja2}{header}<think>\n\n</think>\n\n"));
    let think = [32, 88, 76, 77, 82, 79, 34, 203, 203, 32, 19, 88, 76, 77, 82, 79, 34, 203, 203];
    assert_eq!(ids, [[&LLAMA_PREFIX_IDS[..], &header_ids, &think].concat()]);

    // The same template from a raw .jinja file, with the special tokens given explicitly.
    let special = SpecialTokens::new([("bos_token", "<|begin_of_text|>"), ("eos_token", "<|eot_id|>")]);
    let from_jinja = ChatTemplate::from_file(data("llama3-style.jinja"), special).unwrap();
    let body = chat_body("");
    let ParsedRequest::Chat(chat) = ParsedRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap()
    else {
        unreachable!()
    };
    assert_eq!(
        from_jinja
            .render(&chat.messages, Variables { add_generation_prompt: true, ..Variables::default() })
            .unwrap(),
        format!("{jinja2}{header}")
    );

    // The template's raise_exception becomes a 400.
    let body = r#"{"model":"tiny","messages":[{"role":"user","content":"a"},{"role":"user","content":"b"}]}"#;
    let err = tokens(&t, Endpoint::ChatCompletions, body).unwrap_err();
    assert!(matches!(err, RequestError::Template(_)), "{err:?}");
    assert_eq!(err.http_status(), 400);
}

#[test]
fn hf_without_template_rejects_chat_only() {
    let config = TokenizationConfig { tokenizer_config: None, ..hf_config() };
    let t = Tokenization::new(&config).unwrap();
    assert!(t.chat_template().is_none());
    let body = r#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#;
    assert!(matches!(tokens(&t, Endpoint::ChatCompletions, body), Err(RequestError::NoChatTemplate)));
    assert!(tokens(&t, Endpoint::Completions, r#"{"model":"tiny","prompt":"hi"}"#).is_ok());
    // An explicit template file wins.
    let config = TokenizationConfig { chat_template: Some(data("tiny-tokenizer_config.json")), ..config };
    assert!(tokens(&Tokenization::new(&config).unwrap(), Endpoint::ChatCompletions, body).is_ok());
}

/// A model directory as vLLM reads it: the `tokenizer_config.json` beside the
/// `tokenizer.json` gives the chat template and special tokens, whether the tokenizer is named
/// by its file or by the directory.
#[test]
fn a_model_directory_brings_its_tokenizer_config() {
    let root = std::env::temp_dir().join(format!("kvroute-model-dir-{}", std::process::id()));
    let (dir, empty) = (root.join("model"), root.join("empty"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(data("tiny-tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let chat = r#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#;
    let alone = TokenizationConfig {
        tokenizer: TokenizerSpec::HuggingFace { path: dir.join("tokenizer.json") },
        tokenizer_config: None,
        ..hf_config()
    };
    let t = Tokenization::new(&alone).unwrap();
    assert!(matches!(tokens(&t, Endpoint::ChatCompletions, chat), Err(RequestError::NoChatTemplate)));
    assert!(matches!(
        kvroute_proto::openai::tokenizer_path_problem("--tokenizer", &dir.join("nothing")),
        Some(p) if p.contains("not a readable file")
    ));

    std::fs::copy(data("tiny-tokenizer_config.json"), dir.join("tokenizer_config.json")).unwrap();
    let expected =
        tokens(&Tokenization::new(&hf_config()).unwrap(), Endpoint::ChatCompletions, chat).unwrap();
    for path in [dir.join("tokenizer.json"), dir.clone()] {
        assert_eq!(kvroute_proto::openai::tokenizer_path_problem("--tokenizer", &path), None);
        let config = TokenizationConfig { tokenizer: TokenizerSpec::HuggingFace { path }, ..alone.clone() };
        let t = Tokenization::new(&config).unwrap();
        assert_eq!(tokens(&t, Endpoint::ChatCompletions, chat).unwrap(), expected);
    }
    let problem = kvroute_proto::openai::tokenizer_path_problem("--tokenizer", &empty).unwrap();
    assert!(problem.contains("without a tokenizer.json"), "{problem}");

    // One found that cannot be read stops nothing (completions are served, chats refused);
    // one given stops the start.
    std::fs::write(dir.join("tokenizer_config.json"), "{ not json").unwrap();
    let t = Tokenization::new(&TokenizationConfig {
        tokenizer: TokenizerSpec::HuggingFace { path: dir.clone() },
        ..alone.clone()
    })
    .unwrap();
    assert!(t.template_problem().is_some());
    assert!(matches!(tokens(&t, Endpoint::ChatCompletions, chat), Err(RequestError::NoChatTemplate)));
    assert!(tokens(&t, Endpoint::Completions, r#"{"model":"tiny","prompt":"hi"}"#).is_ok());
    // A template given needs its special tokens: it would render wrong without them.
    let with_template = TokenizationConfig {
        tokenizer: TokenizerSpec::HuggingFace { path: dir.clone() },
        chat_template: Some(data("llama3-style.jinja")),
        ..alone.clone()
    };
    assert!(Tokenization::new(&with_template).is_err());
    let given = TokenizationConfig { tokenizer_config: Some(dir.join("tokenizer_config.json")), ..alone };
    assert!(Tokenization::new(&given).is_err());
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn independent_instances_agree_on_block_hashes() {
    let long_prompt =
        "The router and the replica must compute the same token ids for the same request. ".repeat(20);
    let bodies = [
        (Endpoint::Completions, format!(r#"{{"model":"M","prompt":"{long_prompt}","cache_salt":"t1"}}"#)),
        (Endpoint::Completions, format!(r#"{{"model":"A","prompt":["{long_prompt}","{long_prompt}x"]}}"#)),
        (
            Endpoint::ChatCompletions,
            format!(r#"{{"model":"M","messages":[{{"role":"user","content":"{long_prompt}"}}]}}"#),
        ),
    ];
    for spec in [builtin_config(), hf_config()] {
        let config: TokenizationConfig = serde_json::from_value(serde_json::json!({
            "base_model": "M",
            "lora_adapters": ["A"],
            "tokenizer": spec.tokenizer,
            "tokenizer_config": spec.tokenizer_config,
        }))
        .unwrap();
        let router = Tokenization::new(&config).unwrap();
        let agent = Tokenization::new(&config.clone()).unwrap();
        for (endpoint, body) in &bodies {
            let a = ParsedRequest::parse(*endpoint, body.as_bytes()).unwrap();
            let b = ParsedRequest::parse(*endpoint, body.as_bytes()).unwrap();
            let (ha, hb) = (router.block_hashes(&a, 16).unwrap(), agent.block_hashes(&b, 16).unwrap());
            assert!(ha.iter().all(|h| h.len() >= 8), "{body}: {ha:?}");
            assert_eq!(ha, hb);
            // block_hashes is exactly the proto chain over prompt_tokens in namespace().
            let ns = router.namespace(&a);
            let chained: Vec<_> = router.prompt_tokens(&a).unwrap().iter().map(|t| ns.chain(t, 16)).collect();
            assert_eq!(ha, chained);
        }
    }
}

#[test]
fn namespace_from_model_adapters_and_salt() {
    let t = Tokenization::new(&builtin_config()).unwrap();
    let ns = |body: &str| t.namespace(&ParsedRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap());
    assert_eq!(ns(r#"{"model":"demo","prompt":"x"}"#), CacheNamespace::new("demo"));
    assert_eq!(
        ns(r#"{"model":"demo-lora","prompt":"x"}"#),
        CacheNamespace::new("demo").with_lora("demo-lora")
    );
    // Unknown names (aliases of the base model) are not adapters.
    assert_eq!(ns(r#"{"model":"alias","prompt":"x"}"#), CacheNamespace::new("demo"));
    assert_eq!(
        ns(r#"{"model":"demo-lora","prompt":"x","cache_salt":"tenant"}"#),
        CacheNamespace::new("demo").with_lora("demo-lora").with_salt("tenant")
    );
    // Same tokens, different tenants: no shared blocks.
    let a = t.block_hashes(
        &ParsedRequest::parse(Endpoint::Completions, br#"{"model":"demo","prompt":[1,2,3,4]}"#).unwrap(),
        2,
    );
    let b = t.block_hashes(
        &ParsedRequest::parse(
            Endpoint::Completions,
            br#"{"model":"demo","prompt":[1,2,3,4],"cache_salt":"s"}"#,
        )
        .unwrap(),
        2,
    );
    assert_ne!(a.unwrap(), b.unwrap());
}

#[test]
fn config_is_strict_serde() {
    let config: TokenizationConfig = serde_json::from_str(r#"{"base_model":"m"}"#).unwrap();
    assert_eq!(config.tokenizer, TokenizerSpec::Builtin);
    let config: TokenizationConfig = serde_json::from_str(
        r#"{"base_model":"m","tokenizer":{"kind":"hugging_face","path":"/x/tokenizer.json"}}"#,
    )
    .unwrap();
    assert_eq!(config.tokenizer, TokenizerSpec::HuggingFace { path: "/x/tokenizer.json".into() });
    assert!(serde_json::from_str::<TokenizationConfig>(r#"{"base_model":"m","tokenizr":{}}"#).is_err());
    assert!(matches!(
        Tokenization::new(&TokenizationConfig {
            chat_template: Some(data("missing.jinja")),
            ..builtin_config()
        }),
        Err(LoadError::Io { .. })
    ));
}

#[test]
fn taking_prompt_tokens_gives_what_reading_them_gives() {
    let t = Tokenization::new(&builtin_config()).unwrap();
    for body in [
        r#"{"model":"demo","prompt":[5, 17, 30000]}"#,
        r#"{"model":"demo","prompt":[[5, 17], [99]]}"#,
        r#"{"model":"demo","prompt":"text is tokenized either way"}"#,
        r#"{"model":"demo","prompt":["two", "texts"]}"#,
        r#"{"model":"demo","prompt":[5, 40000]}"#,
        r#"{"model":"demo","prompt":[[5], [40000]]}"#,
        r#"{"model":"demo","prompt":[40000, 5, 6, 7],"truncate_prompt_tokens":3}"#,
        r#"{"model":"demo","prompt":[[40000, 5], [6, 40000]],"truncate_prompt_tokens":1}"#,
    ] {
        let read = tokens(&t, Endpoint::Completions, body).map_err(|e| e.to_string());
        let mut request = ParsedRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap();
        let taken = t.take_prompt_tokens(&mut request).map_err(|e| e.to_string());
        assert_eq!(taken, read, "{body}");
    }
}

/// A chat with media: exact token ids are refused, and what is certain is the conversation
/// before the first message with media, however the replica's model renders the media.
#[test]
fn chats_with_media_are_known_up_to_their_first_media() {
    let image = r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}"#;
    let chat = |messages: &str| format!(r#"{{"model":"tiny","messages":{messages}}}"#);
    let history =
        format!(r#"{},{{"role":"assistant","content":"Paris."}}"#, CONVERSATION.trim_end_matches(']'));
    let with_media = chat(&format!(
        r#"{history},{{"role":"user","content":[{{"type":"text","text":"And this?"}},{image}]}}]"#
    ));
    // What the replica's prompt could be, with the image as one model or another renders it.
    let renderings = [r"<image>\nAnd this?", "And this?<|image_pad|><|image_pad|>", r"And this?\n[img]"]
        .map(|content| chat(&format!(r#"{history},{{"role":"user","content":"{content}"}}]"#)));
    let media_left_out = chat(&format!(r#"{history},{{"role":"user","content":"And this?"}}]"#));
    let before_media = format!(r#"{{"model":"tiny","add_generation_prompt":false,"messages":{history}]}}"#);

    for config in [builtin_config(), hf_config()] {
        let t = Tokenization::new(&config).unwrap();
        let parsed = ParsedRequest::parse(Endpoint::ChatCompletions, with_media.as_bytes()).unwrap();
        let ParsedRequest::Chat(request) = &parsed else { unreachable!() };
        assert_eq!(request.first_media(), Some((5, "image_url")));
        match t.prompt_tokens(&parsed) {
            Err(RequestError::UnsupportedContentPart { index: 5, part_type }) => {
                assert_eq!(part_type, "image_url")
            }
            other => panic!("{other:?}"),
        }
        let partial = t.partial_chat_tokens(request).unwrap();
        for rendering in &renderings {
            let full = &tokens(&t, Endpoint::ChatCompletions, rendering).unwrap()[0];
            assert!(full.starts_with(&partial.tokens), "{:?}: {rendering}", config.tokenizer);
        }
        let before = &tokens(&t, Endpoint::ChatCompletions, &before_media).unwrap()[0];
        assert!(partial.tokens == *before && before.len() > 16, "{:?}", config.tokenizer);
        assert_eq!(
            partial.text_tokens,
            tokens(&t, Endpoint::ChatCompletions, &media_left_out).unwrap()[0].len()
        );
        // `-1` cuts nothing while the context is unknown, or ample: the same prefix is known.
        let minus_one =
            with_media.replace(r#"{"model":"tiny","#, r#"{"model":"tiny","truncate_prompt_tokens":-1,"#);
        let parsed = ParsedRequest::parse(Endpoint::ChatCompletions, minus_one.as_bytes()).unwrap();
        let ParsedRequest::Chat(cut) = &parsed else { unreachable!() };
        assert_eq!(t.partial_chat_tokens(cut).unwrap().tokens, partial.tokens);
        t.set_context_len(1 << 20);
        assert_eq!(t.partial_chat_tokens(cut).unwrap().tokens, partial.tokens);
        t.set_context_len(4096);
        assert!(t.partial_chat_tokens(cut).unwrap().tokens.is_empty(), "the media may fill the room left");
        t.set_context_len(0);

        // Media in the first message: nothing is certain.
        let first = chat(&format!(r#"[{{"role":"user","content":[{image},"What is it?"]}}]"#));
        let ParsedRequest::Chat(request) =
            ParsedRequest::parse(Endpoint::ChatCompletions, first.as_bytes()).unwrap()
        else {
            unreachable!()
        };
        let partial = t.partial_chat_tokens(&request).unwrap();
        assert!(partial.tokens.is_empty() && partial.text_tokens > 0);
    }

    // A template that does not render each message on its own (it counts them first): the
    // messages before the media do not begin the prompt, so nothing is certain.
    let counting = ChatTemplate::new(
        "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
        SpecialTokens::builtin(),
    )
    .unwrap();
    let t = Tokenization::from_parts(Box::new(Builtin), Some(counting), "tiny", []);
    let ParsedRequest::Chat(request) =
        ParsedRequest::parse(Endpoint::ChatCompletions, with_media.as_bytes()).unwrap()
    else {
        unreachable!()
    };
    let partial = t.partial_chat_tokens(&request).unwrap();
    assert!(partial.tokens.is_empty() && partial.text_tokens > 0);

    // Continuing the final message with the default generation prompt is refused as a chat
    // without media is (transformers refuses it): the estimate does not render it whole.
    let continued = with_media.replacen('{', r#"{"continue_final_message":true,"#, 1);
    let ParsedRequest::Chat(request) =
        ParsedRequest::parse(Endpoint::ChatCompletions, continued.as_bytes()).unwrap()
    else {
        unreachable!()
    };
    let refused = t.partial_chat_tokens(&request);
    assert!(matches!(refused, Err(RequestError::CannotContinue(_))), "{refused:?}");
}

/// Rendered as SGLang renders chats: the conversation before the media keeps its last turn
/// (the assistant's) as it is, not made a user turn as at a conversation's end, so all of it
/// is certain; and continuing the final message is no refusal (SGLang has no generation
/// prompt to turn off).
#[test]
fn sglang_chats_with_media_are_known_up_to_their_first_media() {
    let image = r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}"#;
    let history =
        format!(r#"{},{{"role":"assistant","content":"Paris."}}"#, CONVERSATION.trim_end_matches(']'));
    let with_media = format!(
        r#"{{"model":"tiny","messages":{history},{{"role":"user","content":[{{"type":"text","text":"And this?"}},{image}]}}]}}"#
    );
    let before_media = format!(r#"{{"model":"tiny","add_generation_prompt":false,"messages":{history}]}}"#);
    let vllm = Tokenization::new(&builtin_config()).unwrap();
    let before = &tokens(&vllm, Endpoint::ChatCompletions, &before_media).unwrap()[0];
    let mut t = Tokenization::new(&builtin_config()).unwrap();
    t.render_as_sglang();
    for body in [with_media.clone(), with_media.replacen('{', r#"{"continue_final_message":true,"#, 1)] {
        let ParsedRequest::Chat(request) =
            ParsedRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap()
        else {
            unreachable!()
        };
        let partial = t.partial_chat_tokens(&request).unwrap();
        assert!(partial.tokens == *before && before.len() > 16, "{body}");
    }
}

/// A template that leaves out its default system prompt when the conversation has images, as
/// Llama 3.2 Vision's does: the messages before the image, rendered alone, begin with that
/// prompt and the replica's prompt does not, so only what they share is certain.
#[test]
fn a_template_that_changes_with_images_is_trusted_only_where_it_agrees() {
    let vision = ChatTemplate::new(
        "{%- set ns = namespace(images=false) %}{%- for m in messages %}{%- if m.content is not string %}\
         {%- for c in m.content %}{%- if c.type == 'image' %}{%- set ns.images = true %}{%- endif %}{%- endfor %}\
         {%- endif %}{%- endfor %}{%- if not ns.images %}<|im_start|>system\nDefault.<|im_end|>\n{% endif %}\
         {%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}\
         {%- else %}{% for c in m.content %}{% if c.type == 'image' %}[img]{% else %}{{ c.text }}{% endif %}\
         {%- endfor %}{% endif %}<|im_end|>\n{% endfor %}",
        SpecialTokens::builtin(),
    )
    .unwrap();
    let t = Tokenization::from_parts(Box::new(Builtin), Some(vision), "tiny", []);
    let body = r#"{"model":"tiny","add_generation_prompt":false,"messages":[
        {"role":"system","content":"You look at pictures."},{"role":"user","content":"Hello there."},
        {"role":"assistant","content":"Hi."},
        {"role":"user","content":[{"image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"text","text":"What is it?"}]}]}"#;
    let ParsedRequest::Chat(request) =
        ParsedRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap()
    else {
        unreachable!()
    };
    assert_eq!(
        request.first_media(),
        Some((3, "image_url")),
        "a part with no type but an image_url is an image"
    );
    let partial = t.partial_chat_tokens(&request).unwrap();
    // What vLLM renders: images present, no default system prompt.
    let real = "<|im_start|>system\nYou look at pictures.<|im_end|>\n<|im_start|>user\nHello there.<|im_end|>\n\
                <|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>user\n[img]What is it?<|im_end|>\n";
    let real = Builtin.encode(real, false).unwrap();
    assert!(real.starts_with(&partial.tokens), "{:?} does not begin {real:?}", partial.tokens);
    assert!(!partial.tokens.is_empty() && partial.tokens.len() < 4, "{:?}", partial.tokens);
}

/// A conversation that grows a turn at a time, long enough for several prefix-cache chunks.
fn growing_conversation(turns: usize) -> Vec<String> {
    let mut messages = Vec::new();
    let mut bodies = Vec::new();
    for turn in 0..turns {
        let (role, content) = if turn % 2 == 0 {
            (
                "user",
                format!(
                    "Question {turn}: {}",
                    "what does the naïve café on 東京 street serve? ".repeat(4 * turn + 12)
                ),
            )
        } else {
            (
                "assistant",
                format!(" Answer {turn}:\n{}", "It serves coffee, tea  and cake.\n".repeat(4 * turn + 20)),
            )
        };
        messages.push(serde_json::json!({"role": role, "content": content}));
        bodies.push(serde_json::json!({"model": "tiny", "messages": messages}).to_string());
    }
    bodies
}

#[test]
fn hf_prefix_cache_gives_the_tokenizers_ids_and_reuses_earlier_turns() {
    let plain = Tokenization::new(&hf_config()).unwrap();
    let mut cached = Tokenization::new(&hf_config()).unwrap();
    cached.enable_prefix_cache(1 << 20).unwrap();
    for body in growing_conversation(12) {
        assert_eq!(
            tokens(&cached, Endpoint::ChatCompletions, &body).unwrap(),
            tokens(&plain, Endpoint::ChatCompletions, &body).unwrap()
        );
        // The same conversation as a completion prompt, with the BOS the post-processor adds.
        let text = plain
            .render_chat(match &ParsedRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap() {
                ParsedRequest::Chat(r) => r,
                ParsedRequest::Completion(_) => unreachable!(),
            })
            .unwrap();
        let completion =
            serde_json::json!({"model": "tiny", "prompt": format!("{text}<|eot_id|> tail")}).to_string();
        assert_eq!(
            tokens(&cached, Endpoint::Completions, &completion).unwrap(),
            tokens(&plain, Endpoint::Completions, &completion).unwrap()
        );
    }
    let stats = cached.prefix_cache_stats().unwrap();
    // Earlier turns end in added tokens, where a new turn resumes.
    assert!(stats.reused_bytes > stats.tokenized_bytes, "{stats:?}");
}

/// A change to a `tokenizer.json`.
type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;

/// The tiny tokenizer with one change to its JSON.
fn tiny_with(change: impl FnOnce(&mut serde_json::Value)) -> HuggingFace {
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data("tiny-tokenizer.json")).unwrap()).unwrap();
    change(&mut json);
    HuggingFace::from_bytes(json.to_string().as_bytes()).unwrap()
}

#[test]
fn hf_tokenizers_that_cannot_resume_after_added_tokens_are_not_cached() {
    assert!(tiny_with(|_| {}).resume().is_ok());
    let cases: [(&str, Edit); 6] = [
        ("strips", Box::new(|j| j["added_tokens"][4]["rstrip"] = true.into())),
        (
            "truncates",
            Box::new(|j| {
                j["truncation"] = serde_json::json!({"direction": "Right", "max_length": 512, "strategy": "LongestFirst", "stride": 0});
            }),
        ),
        (
            "encodes differently",
            // An end-of-text id after the text: not a prefix that stays put.
            Box::new(|j| {
                j["post_processor"]["single"] = serde_json::json!([
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}]);
            }),
        ),
        ("normalized", Box::new(|j| j["added_tokens"][1]["normalized"] = true.into())),
        ("no added tokens", Box::new(|j| j["added_tokens"] = serde_json::json!([]))),
        (
            "encodes differently",
            // Metaspace puts its marker only before the text's first part.
            Box::new(|j| {
                j["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Metaspace", "replacement": "_", "prepend_scheme": "first", "split": false},
                    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]});
            }),
        ),
    ];
    for (why, change) in cases {
        let tokenizer = tiny_with(change);
        let reason = tokenizer.resume().err().map(str::to_owned);
        assert!(reason.as_deref().is_some_and(|r| r.contains(why)), "{why}: {reason:?}");
        let mut t = Tokenization::from_parts(Box::new(tokenizer), None, "tiny", []);
        assert!(t.enable_prefix_cache(1 << 20).is_err());
    }
}

/// The tiny tokenizer with one more added token that extends another (`<|eot_id|>` and
/// `<|eot_id|>!!`), so that a match depends on the bytes after the shorter one.
fn tiny_with_overlapping_tokens() -> HuggingFace {
    tiny_with(|j| {
        j["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({
            "id": 400, "content": "<|eot_id|>!!", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}));
    })
}

fn hf_text() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    proptest::collection::vec(
        prop_oneof![
            4 => "[a-zA-Z ]{1,12}",
            2 => "[ \\n\\t.,!?'0-9]{1,4}",
            1 => "[éü東京😀]{1,3}",
            2 => proptest::sample::select(vec![
                "<|eot_id|>".to_string(), "<|eot_id|>!".into(), "<|eot_id|>!!".into(), "<|begin_of_text|>".into(),
                "<|start_header_id|>user<|end_header_id|>\n\n".into(), "<|eot".into(), "!".into(),
            ]),
        ],
        0..24,
    )
    .prop_map(|parts| parts.concat())
}

/// [`hf_text`], often after a `!` or two, which make `<|eot_id|>!!` of a `<|eot_id|>` or
/// `<|eot_id|>!` just before them.
fn hf_tail() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    ("!{0,2}", hf_text()).prop_map(|(a, b)| a + &b)
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config::with_cases(96))]
    /// The resume contract for a `tokenizer.json`: a text that agrees with another up to a
    /// resume point and the lookahead encodes to the other's ids before the point, then its
    /// own from the point on; and the prefix cache (small chunks, so texts span several)
    /// gives what the tokenizer gives.
    #[test]
    fn hf_resume_points_hold_for_any_continuation(
        t in hf_text(),
        tail in hf_tail(),
        chunk_keep in 0.0..1.0f64,
    ) {
        use kvroute_proto::openai::tokenizer::Points;
        let tok = tiny_with_overlapping_tokens();
        let resume = tok.resume().unwrap();
        let whole = tok.encode(&t, false).unwrap();
        let mut points = Points::new((0..t.len()).collect());
        let mut ids = Vec::new();
        resume.encode_from(&t, 0, &mut ids, &mut points).unwrap();
        proptest::prop_assert_eq!(&ids, &whole);
        let mut found = points.found().to_vec();
        found.dedup();
        for point in found {
            let agreed = point.byte + resume.lookahead();
            if agreed > t.len() || !t.is_char_boundary(agreed) {
                continue;
            }
            let u = format!("{}{tail}", &t[..agreed]);
            let mut resumed = whole[..point.ids].to_vec();
            resumed.extend(tok.encode(&u[point.byte..], false).unwrap());
            proptest::prop_assert_eq!(tok.encode(&u, false).unwrap(), resumed, "{:?} at {}", u, point.byte);
        }
        let mut cut = (t.len() as f64 * chunk_keep) as usize;
        while !t.is_char_boundary(cut) {
            cut -= 1;
        }
        let cache = PrefixCache::with_chunk(1 << 20, 24);
        for text in [t.clone(), format!("{}{tail}", &t[..cut]), format!("{t}{tail}")] {
            for special in [false, true] {
                proptest::prop_assert_eq!(cache.encode(resume, &text, special).unwrap(), tok.encode(&text, special).unwrap());
            }
        }
    }
}

/// The fleet's chat flags reach the template through the config: a request's own template
/// is refused unless trusted, and then renders the prompt; a forced content format changes
/// what the default ChatML template writes.
#[test]
fn chat_options_in_the_config_change_the_prompt() {
    let chat = |extra: &str| {
        format!(r#"{{"model":"demo","messages":[{{"role":"user","content":"hi there"}}]{extra}}}"#)
    };
    let own = r#","chat_template":"{{ messages[0].content }} again""#;
    let plain = Tokenization::new(&builtin_config()).unwrap();
    assert!(matches!(
        tokens(&plain, Endpoint::ChatCompletions, &chat(own)),
        Err(RequestError::UntrustedChatTemplate)
    ));
    let trusting = Tokenization::new(&TokenizationConfig {
        chat: ChatOptions { trust_request_chat_template: true, ..ChatOptions::default() },
        ..builtin_config()
    })
    .unwrap();
    let expected = plain.tokenizer().encode("hi there again", false).unwrap();
    assert_eq!(tokens(&trusting, Endpoint::ChatCompletions, &chat(own)).unwrap(), vec![expected]);
    let forced = Tokenization::new(&TokenizationConfig {
        chat: ChatOptions {
            chat_template_content_format: ContentFormatOption::Openai,
            ..ChatOptions::default()
        },
        ..builtin_config()
    })
    .unwrap();
    let as_parts = tokens(&forced, Endpoint::ChatCompletions, &chat("")).unwrap();
    assert_ne!(as_parts, tokens(&plain, Endpoint::ChatCompletions, &chat("")).unwrap());
}

/// `add_bos_token` / `add_eos_token` in the tokenizer config decide the special tokens
/// around a text, over `tokenizer.json`'s post-processor, as transformers 5 builds them (an
/// absent flag is false); without either, the post-processor stays.
#[test]
fn the_configs_bos_and_eos_flags_replace_the_post_processor() {
    let hello = |t: &Tokenization| {
        tokens(t, Endpoint::Completions, r#"{"model":"tiny","prompt":"Hello, world!"}"#).unwrap().remove(0)
    };
    let with_flags = |name: &str, flags: serde_json::Value| {
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(data("tiny-tokenizer_config.json")).unwrap()).unwrap();
        config.as_object_mut().unwrap().extend(flags.as_object().unwrap().clone());
        let path = std::env::temp_dir().join(format!("kvroute-{name}-{}.json", std::process::id()));
        std::fs::write(&path, config.to_string()).unwrap();
        let t =
            Tokenization::new(&TokenizationConfig { tokenizer_config: Some(path.clone()), ..hf_config() });
        std::fs::remove_file(&path).ok();
        hello(&t.unwrap())
    };
    let file_default = hello(&Tokenization::new(&hf_config()).unwrap());
    let plain = with_flags("no-bos", serde_json::json!({"add_bos_token": false}));
    assert_eq!(
        file_default[1..],
        plain[..],
        "the fixture's post-processor adds a BOS; the flag takes it off"
    );
    let both = with_flags("bos-eos", serde_json::json!({"add_bos_token": true, "add_eos_token": true}));
    assert_eq!(both.len(), plain.len() + 2);
    assert_eq!(both[..both.len() - 1], file_default[..]);
    assert_ne!(both.last(), file_default.last(), "an EOS after the text");
}

/// `truncate_prompt_tokens` keeps what vLLM keeps: with a tokenizer that adds a BOS, by
/// default (the tokenizer's left truncation) the BOS and the text's last tokens; with
/// `truncation_side` the last or first of the whole encoding; token ids and chats their last.
#[test]
fn truncated_prompts_keep_what_vllm_keeps() {
    let t = Tokenization::new(&hf_config()).unwrap();
    let completion = |extra: &str| {
        let body =
            format!(r#"{{"model":"tiny","prompt":"the quick brown fox jumps over the lazy dog"{extra}}}"#);
        tokens(&t, Endpoint::Completions, &body).unwrap().remove(0)
    };
    let whole = completion("");
    let bos = t.tokenizer().encode("", true).unwrap();
    assert_eq!(bos.len(), 1, "the fixture adds a BOS");
    assert_eq!(whole[0], bos[0]);
    assert!(whole.len() > 5);
    let last = |n: usize| whole[whole.len() - n..].to_vec();
    assert_eq!(completion(r#","truncate_prompt_tokens":4"#), [vec![bos[0]], last(3)].concat());
    assert_eq!(completion(r#","truncate_prompt_tokens":4,"truncation_side":"left""#), last(4));
    assert_eq!(completion(r#","truncate_prompt_tokens":4,"truncation_side":"right""#), whole[..4].to_vec());
    assert_eq!(completion(r#","truncate_prompt_tokens":-1"#), whole, "the context length: not known yet");
    assert_eq!(completion(&format!(r#","truncate_prompt_tokens":{}"#, whole.len())), whole);
    // Known (from the replicas' model cards), -1 keeps the context less the output tokens, as
    // vLLM's `max_input_tokens`; the chat is cut from the left.
    t.set_context_len(6);
    assert_eq!(
        completion(r#","truncate_prompt_tokens":-1,"max_tokens":2"#),
        [vec![bos[0]], last(3)].concat()
    );
    assert_eq!(
        completion(r#","truncate_prompt_tokens":"-1","max_tokens":2"#),
        [vec![bos[0]], last(3)].concat()
    );
    // A completion's output is 16 when `max_tokens` is unset, as vLLM's.
    t.set_context_len(20);
    assert_eq!(completion(r#","truncate_prompt_tokens":-1"#), [vec![bos[0]], last(3)].concat());
    t.set_context_len(6);
    let chat_whole = tokens(&t, Endpoint::ChatCompletions, &chat_body("")).unwrap().remove(0);
    let chat_cut = |extra: &str| tokens(&t, Endpoint::ChatCompletions, &chat_body(extra)).unwrap().remove(0);
    let kept = chat_whole[chat_whole.len() - 5..].to_vec();
    assert_eq!(chat_cut(r#","truncate_prompt_tokens":-1,"max_completion_tokens":1,"max_tokens":3"#), kept);
    // A Responses request's `truncation: "auto"` is -1 (with its `max_output_tokens`).
    let responses = |truncation: &str| {
        let body = format!(
            r#"{{"model":"tiny","input":"the quick brown fox jumps over the lazy dog","max_output_tokens":2{truncation}}}"#
        );
        let (read_as, chat) = t.readable(Endpoint::Responses, body.as_bytes()).unwrap();
        tokens(&t, read_as, std::str::from_utf8(&chat).unwrap()).unwrap().remove(0)
    };
    let untruncated = responses("");
    assert!(untruncated.len() > 4);
    assert_eq!(responses(r#","truncation":"disabled""#), untruncated);
    assert_eq!(responses(r#","truncation":"auto""#).len(), 4);
    assert!(
        t.readable(Endpoint::Responses, br#"{"model":"tiny","input":"x","truncation":"middle"}"#).is_err()
    );
    t.set_context_len(0);
    let ids = |extra: &str| {
        let body = format!(r#"{{"model":"tiny","prompt":[5,6,7,8,9]{extra}}}"#);
        let mut request = ParsedRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap();
        let taken = t.take_prompt_tokens(&mut request).unwrap();
        assert_eq!(tokens(&t, Endpoint::Completions, &body).unwrap(), taken, "both ways alike");
        taken.concat()
    };
    assert_eq!(ids(r#","truncate_prompt_tokens":2"#), [8, 9]);
    assert_eq!(ids(r#","truncate_prompt_tokens":2,"truncation_side":"right""#), [5, 6]);
    let chat = |extra: &str| tokens(&t, Endpoint::ChatCompletions, &chat_body(extra)).unwrap().remove(0);
    let whole = chat("");
    assert_eq!(chat(r#","truncate_prompt_tokens":3"#), whole[whole.len() - 3..].to_vec());
    for bad in
        [r#","truncate_prompt_tokens":0"#, r#","truncate_prompt_tokens":-2"#, r#","truncation_side":"up""#]
    {
        assert!(tokens(&t, Endpoint::ChatCompletions, &chat_body(bad)).is_err(), "{bad}");
    }
}

/// `tool_choice: none` reaches the template through the Messages and Responses conversions
/// too, so `--exclude-tools-when-tool-choice-none` leaves their tools out as vLLM does.
#[test]
fn tool_choice_none_carries_through_messages_and_responses() {
    let dir = std::env::temp_dir().join(format!("kvroute-tool-choice-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("template.jinja");
    std::fs::write(&path, "{{ tools is none }}{% for m in messages %}|{{ m.content }}{% endfor %}").unwrap();
    let tokenization = |exclude: bool| {
        let chat = ChatOptions { exclude_tools_when_tool_choice_none: exclude, ..ChatOptions::default() };
        Tokenization::new(&TokenizationConfig { chat_template: Some(path.clone()), chat, ..builtin_config() })
            .unwrap()
    };
    let (excluding, keeping) = (tokenization(true), tokenization(false));
    std::fs::remove_dir_all(&dir).ok();
    let ids = |t: &Tokenization, endpoint: Endpoint, body: &str| {
        let (endpoint, body) = t.readable(endpoint, body.as_bytes()).unwrap();
        tokens(t, endpoint, std::str::from_utf8(&body).unwrap()).unwrap()
    };
    let messages_tools = r#""tools":[{"name":"f","input_schema":{"type":"object"}}]"#;
    let responses_tools = r#""tools":[{"type":"function","name":"f","parameters":{"type":"object"}}]"#;
    let cases = [
        (
            Endpoint::Messages,
            format!(
                r#"{{"model":"demo","max_tokens":5,"messages":[{{"role":"user","content":"hi"}}],{messages_tools}"#
            ),
            r#","tool_choice":{"type":"none"}}"#,
        ),
        (
            Endpoint::Responses,
            format!(r#"{{"model":"demo","input":"hi",{responses_tools}"#),
            r#","tool_choice":"none"}"#,
        ),
    ];
    for (endpoint, open, none) in cases {
        let (with_none, plain) = (format!("{open}{none}"), format!("{open}}}"));
        let no_tools = excluding.tokenizer().encode("True|hi", false).unwrap();
        assert_eq!(ids(&excluding, endpoint, &with_none), vec![no_tools.clone()], "{endpoint:?}");
        assert_ne!(
            ids(&excluding, endpoint, &plain),
            vec![no_tools.clone()],
            "{endpoint:?}: no choice, tools"
        );
        assert_ne!(ids(&keeping, endpoint, &with_none), vec![no_tools], "{endpoint:?}: without the flag");
    }
}

/// A gpt-oss model (its template in Harmony's format): chats are tokenized from vLLM's
/// Harmony rendering, piece by piece with the special tokens by id, not from the template,
/// tools included; a chat with tools vLLM refuses falls back to the template; an effort
/// Harmony lacks is a 400.
#[test]
fn a_harmony_models_chats_are_tokenized_from_harmony_pieces() {
    let config = TokenizationConfig {
        tokenizer: TokenizerSpec::HuggingFace { path: data("tiny-harmony-tokenizer.json") },
        tokenizer_config: Some(data("tiny-harmony-tokenizer_config.json")),
        ..hf_config()
    };
    let mut t = Tokenization::new(&config).unwrap();
    assert!(t.chat_template().unwrap().is_harmony());

    let body = r#"{"model":"tiny","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello"}],
        "reasoning_effort":"low"}"#;
    let ids = tokens(&t, Endpoint::ChatCompletions, body).unwrap().remove(0);
    // A special token's text in a message is text, as Harmony's `encode_ordinary` writes it:
    // `<|end|>` (id 402) only ends messages.
    let quoted = r#"{"model":"tiny","messages":[{"role":"user","content":"what is <|end|>?"}]}"#;
    let quoted = tokens(&t, Endpoint::ChatCompletions, quoted).unwrap().remove(0);
    assert_eq!(quoted.iter().filter(|&&id| id == 402).count(), 2, "the system message's and the user's ends");
    let completion = |text: &str| {
        let body =
            serde_json::json!({"model": "tiny", "prompt": text, "add_special_tokens": false}).to_string();
        tokens(&t, Endpoint::Completions, &body).unwrap().remove(0)
    };
    let today = std::env::var("VLLM_SYSTEM_START_DATE").unwrap_or_else(|_| {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
        let z = (secs / 86_400) as i64 + 719_468;
        let (era, doe) = (z.div_euclid(146_097), z.rem_euclid(146_097));
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let (d, m) = (doy - (153 * mp + 2) / 5 + 1, if mp < 10 { mp + 3 } else { mp - 9 });
        format!("{:04}-{m:02}-{d:02}", yoe + era * 400 + i64::from(m <= 2))
    });
    let system = format!(
        "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\
         Current date: {today}\n\nReasoning: low\n\n# Valid channels: analysis, commentary, final. \
         Channel must be included for every message."
    );
    let special = |token: &str| match completion(token)[..] {
        [id] => id,
        ref other => panic!("{token} is {other:?}"),
    };
    let (start, message, end) = (special("<|start|>"), special("<|message|>"), special("<|end|>"));
    // The prompt of a chat of one user message "Hello", with these system and developer texts.
    let hello = |system: &str, developer: &str| {
        [
            vec![start],
            completion("system"),
            vec![message],
            completion(system),
            vec![end, start],
            completion("developer"),
            vec![message],
            completion(developer),
            vec![end, start],
            completion("user"),
            vec![message],
            completion("Hello"),
            vec![end, start],
            completion("assistant"),
        ]
        .concat()
    };
    assert_eq!(ids, hello(&system, "# Instructions\n\nBe brief."));
    // Nor does it look at `continue_final_message` (a template refuses it with the default
    // generation prompt).
    let continued =
        body.replace(r#""reasoning_effort""#, r#""continue_final_message":true,"reasoning_effort""#);
    assert_eq!(tokens(&t, Endpoint::ChatCompletions, &continued).unwrap(), std::slice::from_ref(&ids));
    let template = Tokenization::new(&hf_config()).unwrap();
    let refused = tokens(&template, Endpoint::ChatCompletions, &continued).unwrap_err();
    assert!(matches!(refused, RequestError::CannotContinue(_)), "{refused}");
    // vLLM's Harmony path never truncates.
    let truncated = body.replace(r#""reasoning_effort""#, r#""truncate_prompt_tokens":3,"reasoning_effort""#);
    assert_eq!(tokens(&t, Endpoint::ChatCompletions, &truncated).unwrap(), [ids]);

    // Tools: a TypeScript namespace in the developer message, and a line in the system
    // message on where calls to them go.
    let tools = r#"{"model":"tiny","messages":[{"role":"user","content":"Hello"}],"reasoning_effort":"low",
        "tools":[{"type":"function","function":{"name":"f"}}]}"#;
    let with_tools = hello(
        &format!("{system}\nCalls to these tools must go to the commentary channel: 'functions'."),
        "# Tools\n\n## functions\n\nnamespace functions {\n\ntype f = () => any;\n\n} // namespace functions",
    );
    assert_eq!(tokens(&t, Endpoint::ChatCompletions, tools).unwrap(), [with_tools]);
    // A tool call in the history: its content type after `<|constrain|>`, as oss-harmony
    // writes it.
    let call = r#"{"model":"tiny","messages":[{"role":"user","content":"q"},{"role":"assistant","content":null,
        "tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},
        {"role":"tool","tool_call_id":"c","content":"r"}]}"#;
    let ids = tokens(&t, Endpoint::ChatCompletions, call).unwrap();
    assert_eq!(ids[0].iter().filter(|&&id| id == 405).count(), 1, "one <|constrain|>: {ids:?}");
    // A Responses request is read as vLLM reads its items for Harmony: reasoning after an
    // answer is a message of its own, kept.
    let responses = r#"{"model":"tiny","input":[{"role":"user","content":"q"},
        {"type":"message","role":"assistant","content":[{"type":"output_text","text":"a"}]},
        {"type":"reasoning","summary":[],"content":[{"type":"reasoning_text","text":"r"}]},
        {"role":"user","content":"q2"}]}"#;
    let (read_as, chat) = t.readable(Endpoint::Responses, responses.as_bytes()).unwrap();
    let as_harmony = r#"{"model":"tiny","messages":[{"role":"user","content":"q"},
        {"role":"assistant","content":"a"},{"role":"assistant","reasoning":"r"},{"role":"user","content":"q2"}]}"#;
    let expected = tokens(&t, Endpoint::ChatCompletions, as_harmony).unwrap();
    assert_eq!(tokens(&t, read_as, std::str::from_utf8(&chat).unwrap()).unwrap(), expected);
    let (_, template_chat) =
        Tokenization::readable_with(Endpoint::Responses, responses.as_bytes(), t.inline_system(), false)
            .unwrap();
    assert_ne!(tokens(&t, read_as, std::str::from_utf8(&template_chat).unwrap()).unwrap(), expected);
    // Tools vLLM refuses (the replica answers 400) leave the chat to the template.
    let refused_tools = r#"{"model":"tiny","messages":[{"role":"user","content":"Hello"}],
        "tools":[{"type":"retrieval","function":{"name":"f"}}]}"#;
    let from_template = completion("<|start|>user<|channel|>final<|message|>Hello<|end|>");
    assert_eq!(
        tokens(&t, Endpoint::ChatCompletions, refused_tools).unwrap(),
        std::slice::from_ref(&from_template)
    );
    let none = r#"{"model":"tiny","messages":[{"role":"user","content":"Hello"}],"reasoning_effort":"none"}"#;
    let refused = tokens(&t, Endpoint::ChatCompletions, none).unwrap_err();
    assert!(matches!(refused, RequestError::Harmony(_)) && refused.http_status() == 400, "{refused}");

    // Through the prefix cache, long texts are encoded once and the ids stay the same.
    let long = "Hello world ".repeat(40);
    let conversation = serde_json::json!({"model": "tiny", "messages": [
        {"role": "system", "content": long}, {"role": "user", "content": long},
        {"role": "assistant", "content": long}, {"role": "user", "content": "Hi"}]})
    .to_string();
    let uncached = tokens(&t, Endpoint::ChatCompletions, &conversation).unwrap();
    t.enable_prefix_cache(1 << 20).unwrap();
    assert_eq!(tokens(&t, Endpoint::ChatCompletions, &conversation).unwrap(), uncached);
    let first = t.prefix_cache_stats().unwrap();
    assert_eq!(tokens(&t, Endpoint::ChatCompletions, &conversation).unwrap(), uncached);
    let second = t.prefix_cache_stats().unwrap();
    assert_eq!(second.tokenized_bytes, first.tokenized_bytes, "nothing long encoded again");
    assert!(second.reused_bytes >= first.reused_bytes + 3 * long.len() as u64, "{first:?} {second:?}");

    // A fleet whose engine renders such chats with the template (SGLang) gets the template's.
    t.render_as_sglang();
    assert!(!t.is_harmony());
    let hello = r#"{"model":"tiny","messages":[{"role":"user","content":"Hello"}]}"#;
    assert_eq!(tokens(&t, Endpoint::ChatCompletions, hello).unwrap(), [from_template]);
}
