//! Request fields an attacker controls never overflow the agent's bounds checks.

use serde_json::json;

use crate::support::{Agent, MODEL};

/// `prompt length + max_tokens` was computed in u64 without a check: near `u64::MAX` it
/// overflowed (a panic in debug builds; in release it wrapped below `--max-model-len` and the
/// request was admitted with a practically endless completion).
#[tokio::test]
async fn max_tokens_near_u64_max_does_not_overflow_the_context_check() {
    let agent = Agent::start().await;
    for max_tokens in [u64::MAX, u64::MAX - 3, u64::from(u32::MAX) + 1] {
        for (path, body) in [
            ("/v1/completions", json!({"model": MODEL, "prompt": "one two three", "max_tokens": max_tokens})),
            (
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}),
            ),
        ] {
            let reply = agent.client.post(path, &body).await;
            assert_eq!(reply.status, 400, "{path} max_tokens={max_tokens}: {}", reply.text());
            assert!(reply.json()["error"]["message"].is_string());
        }
    }
    let ok = agent
        .client
        .post("/v1/completions", &json!({"model": MODEL, "prompt": "one two", "max_tokens": 2}))
        .await;
    assert_eq!(ok.status, 200, "the agent still serves");
}
