//! Reloading the replica list: a new list's replicas join, those it drops leave, those it
//! keeps are left alone; a replica the fleet refuses is said; and the binary reloads at a
//! `SIGHUP`.

use std::collections::BTreeSet;
use std::sync::Arc;

use kvroute_router::config::Config as RouterConfig;
use kvroute_router::reload::Reloader;
use serde_json::json;

use crate::fleet::{FLEET_MODEL, Fleet, replica_config, router_config};
use crate::support::{wait_until, wait_until_async};

fn names(router: &kvroute_router::RunningRouter) -> BTreeSet<String> {
    router.fleet().members().iter().map(|m| m.replica.spec.name.clone()).collect()
}

#[tokio::test]
async fn a_reload_makes_the_fleet_hold_the_new_list() {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(3, crate::fleet::agent_config, &shutdown).await;
    let first = router_config(&agents[..2]);
    let mut reloader = Reloader::new(&first);
    let second = RouterConfig { replicas: agents[1..].iter().map(replica_config).collect(), ..first.clone() };
    let fleet = Fleet::around(agents, first, shutdown).await;
    let kept = fleet.router.fleet().member("agent-1").unwrap().upstream;

    let reloaded = reloader.apply(&fleet.router.state, &second).await;
    assert_eq!((reloaded.added, reloaded.removed), (vec!["agent-2".to_owned()], vec!["agent-0".to_owned()]));
    assert!(reloaded.replaced.is_empty() && reloaded.refused.is_empty() && reloaded.not_applied.is_empty());
    assert_eq!(names(&fleet.router), BTreeSet::from(["agent-1".to_owned(), "agent-2".to_owned()]));
    let still = fleet.router.fleet().member("agent-1").unwrap().upstream;
    assert!(Arc::ptr_eq(&kept, &still), "a replica the list keeps is left alone");
    let router = fleet.router.fleet().clone();
    wait_until("the new replica syncs", || router.ready()).await;
    for i in 0..6 {
        let ask = json!({"model": FLEET_MODEL, "prompt": format!("reload {i} words"), "max_tokens": 1});
        let reply = fleet.http.post(&fleet.url("/v1/completions"), &ask).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_ne!(reply.header("x-kvroute-replica"), Some("agent-0"), "a removed replica gets nothing");
    }

    // Nothing changed: nothing done. A replica at another's HTTP address is refused and said;
    // a live setting is applied, another is named, not applied.
    assert_eq!(reloader.apply(&fleet.router.state, &second).await, Default::default());
    let mut dup = second.replicas[0].clone();
    dup.name = "dup".into();
    dup.events = crate::support::nowhere();
    let third = RouterConfig {
        replicas: second.replicas.iter().cloned().chain([dup]).collect(),
        policy: kvroute_router::policy::PolicyKind::RoundRobin,
        credit_ttl_ms: second.credit_ttl_ms + 1,
        ..second.clone()
    };
    let reloaded = reloader.apply(&fleet.router.state, &third).await;
    assert_eq!(reloaded.refused.len(), 1, "{reloaded:?}");
    assert_eq!(reloaded.refused[0].0, "dup");
    assert!(reloaded.refused[0].1.contains("HTTP address"), "{}", reloaded.refused[0].1);
    assert_eq!(
        (reloaded.applied, reloaded.not_applied),
        (vec!["policy".to_owned()], vec!["credit-ttl-ms".to_owned()])
    );
    assert_eq!(names(&fleet.router), BTreeSet::from(["agent-1".to_owned(), "agent-2".to_owned()]));

    // The tokenizer's files are read at a start only: one the next start could not read is
    // said, one it could is not.
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/tests/data");
    let missing = data.join("no-such-tokenizer.json");
    let tokenized = RouterConfig { tokenizer: Some(missing), ..third.clone() };
    let reloaded = reloader.apply(&fleet.router.state, &tokenized).await;
    assert!(reloaded.not_applied.contains(&"tokenizer".to_owned()), "{reloaded:?}");
    assert_eq!(reloaded.next_start_fails.len(), 1, "{reloaded:?}");
    assert!(reloaded.next_start_fails[0].contains("no-such-tokenizer.json"), "{reloaded:?}");
    let tokenized = RouterConfig { tokenizer: Some(data.join("tiny-tokenizer.json")), ..third };
    let reloaded = reloader.apply(&fleet.router.state, &tokenized).await;
    assert!(reloaded.next_start_fails.is_empty(), "{reloaded:?}");
}

/// The binary reloads its `--config` file at a `SIGHUP`: the replica the file names now
/// answers; a file that does not parse changes nothing and leaves the router running.
#[tokio::test]
async fn the_router_reloads_its_file_at_a_hangup() {
    const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let (one, _) = crate::headers::recording_replica(ANSWER).await;
    let (two, _) = crate::headers::recording_replica(ANSWER).await;
    let entry = |name: &str, http: std::net::SocketAddr| {
        format!(
            "[[replica]]\nname = \"{name}\"\nhttp = \"http://{http}\"\nevents = \"{}\"\nengine = \"kvroute\"\n",
            crate::support::nowhere()
        )
    };
    let file = std::env::temp_dir().join(format!("kvroute-reload-{}.toml", std::process::id()));
    let write = |text: String| std::fs::write(&file, format!("model = \"{FLEET_MODEL}\"\n{text}")).unwrap();
    write(entry("one", one));
    let port = kvroute_proto::loopback_port::unused().unwrap();
    let (mut router, logs, _) =
        crate::support::router_process(port, &["--config".as_ref(), file.as_ref()], &[]);
    let http = crate::fleet::Http::new();
    let url = format!("http://127.0.0.1:{port}/v1/embeddings");
    let answered_by = async || {
        let reply = http.send_with(http::Method::POST, &url, r#"{"input":"x"}"#, &[]).await;
        reply.header("x-kvroute-replica").map(str::to_owned)
    };
    let served = async || tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok();
    wait_until_async("the router serves", served).await;
    assert_eq!(answered_by().await.as_deref(), Some("one"));
    let hangup = || {
        let pid = libc::pid_t::try_from(router.id().unwrap()).unwrap();
        // SAFETY: `kill` reads its two integer arguments and nothing else.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0, "{}", std::io::Error::last_os_error());
    };

    write("[[replica]\nname = ".into());
    hangup();
    let said = || String::from_utf8_lossy(&logs.lock().unwrap()).contains("cannot be read");
    wait_until("the broken file is reported", said).await;
    assert_eq!(answered_by().await.as_deref(), Some("one"), "a broken file changes nothing");

    write(entry("two", two));
    hangup();
    wait_until_async("the new list is applied", async || answered_by().await.as_deref() == Some("two")).await;
    assert!(router.try_wait().unwrap().is_none(), "still running");
    router.kill().await.unwrap();
    let _ = std::fs::remove_file(&file);
}

/// A reload applies the live settings at once: the policy (a prompt asked again goes where it
/// is cached under cache-aware, and takes turns under round-robin), the API keys (the old key
/// is refused, the new one served) and the prompt bound.
#[tokio::test]
async fn a_reload_retunes_the_policy_the_keys_and_the_bounds() {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(3, crate::fleet::agent_config, &shutdown).await;
    let first = router_config(&agents);
    let mut reloader = Reloader::new(&first);
    let fleet = Fleet::around(agents, first.clone(), shutdown).await;
    let words = (0..40).map(|i| format!("word{i}")).collect::<Vec<_>>().join(" ");
    let ask = json!({"model": FLEET_MODEL, "prompt": words, "max_tokens": 1}).to_string();
    let url = fleet.url("/v1/completions");
    let send = async |key: &str| {
        let auth = format!("Bearer {key}");
        fleet.http.send_with(http::Method::POST, &url, ask.clone(), &[("authorization", &auth)]).await
    };
    let answered_by = async |n: usize| {
        let mut replicas = BTreeSet::new();
        for _ in 0..n {
            let reply = send("none").await;
            assert_eq!(reply.status, 200, "{:?}", reply.body);
            replicas.insert(reply.header("x-kvroute-replica").unwrap().to_owned());
        }
        replicas
    };
    assert_eq!(answered_by(3).await.len(), 1, "cache-aware: to where it is cached");

    let round_robin = RouterConfig { policy: kvroute_router::policy::PolicyKind::RoundRobin, ..first };
    assert_eq!(reloader.apply(&fleet.router.state, &round_robin).await.applied, ["policy"]);
    assert_eq!(answered_by(3).await.len(), 3, "round-robin: in turn");

    let keyed = RouterConfig { api_key: vec!["sk-old".into()], ..round_robin };
    assert_eq!(reloader.apply(&fleet.router.state, &keyed).await.applied, ["api-key"]);
    assert_eq!(send("sk-other").await.status, 401);
    assert_eq!(send("sk-old").await.status, 200);
    let rotated = RouterConfig { api_key: vec!["sk-new".into()], ..keyed };
    assert_eq!(reloader.apply(&fleet.router.state, &rotated).await.applied, ["api-key"]);
    assert_eq!(send("sk-old").await.status, 401, "a rotated key is refused");
    assert_eq!(send("sk-new").await.status, 200);

    let bounded = RouterConfig { max_prompt_tokens: 8, ..rotated };
    assert_eq!(reloader.apply(&fleet.router.state, &bounded).await.applied, ["max-prompt-tokens"]);
    let refused = send("sk-new").await;
    assert_eq!(refused.status, 400, "{:?}", refused.body);
    assert!(refused.json()["error"]["message"].as_str().unwrap().contains("prompt"), "{:?}", refused.body);
}

/// `--api-key-file` named by a reload is read, its keys pass with `--api-key`'s; each reload
/// reads it again; one naming a file that cannot be read keeps the keys in use.
#[tokio::test]
async fn a_reload_reads_the_key_file_again() {
    let dir = crate::support::directory("reload-keys");
    let keys = dir.join("keys");
    std::fs::write(&keys, "sk-file\n").unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(1, crate::fleet::agent_config, &shutdown).await;
    let first = RouterConfig { api_key_check_ms: 0, ..router_config(&agents) };
    let mut reloader = Reloader::new(&first);
    let fleet = Fleet::around(agents, first.clone(), shutdown).await;
    let url = fleet.url("/v1/models");
    let status = async |key: &str| {
        let auth = format!("Bearer {key}");
        fleet.http.send_with(http::Method::GET, &url, String::new(), &[("authorization", &auth)]).await.status
    };
    let statuses = async |keys: [&str; 3]| {
        let mut statuses = Vec::new();
        for key in keys {
            statuses.push(status(key).await);
        }
        statuses
    };

    let keyed = RouterConfig { api_key: vec!["sk-flag".into()], api_key_file: Some(keys.clone()), ..first };
    let reloaded = reloader.apply(&fleet.router.state, &keyed).await;
    assert_eq!(
        (reloaded.applied, reloaded.api_key_file),
        (vec!["api-key".into(), "api-key-file".into()], Some(Ok(1)))
    );
    assert_eq!(statuses(["sk-file", "sk-flag", "sk-next"]).await, [200, 200, 401]);

    std::fs::write(&keys, "sk-next, sk-after").unwrap();
    let reloaded = reloader.apply(&fleet.router.state, &keyed).await;
    assert_eq!(
        (reloaded.applied.len(), reloaded.api_key_file),
        (0, Some(Ok(2))),
        "the same settings, the file read again"
    );
    assert_eq!(statuses(["sk-file", "sk-flag", "sk-next"]).await, [401, 200, 200]);

    let elsewhere = RouterConfig { api_key_file: Some(dir.join("missing")), ..keyed.clone() };
    let reloaded = reloader.apply(&fleet.router.state, &elsewhere).await;
    assert!(reloaded.api_key_file.as_ref().unwrap().as_ref().unwrap_err().contains("missing"));
    assert_eq!(reloaded.not_applied, ["api-key-file"]);
    assert!(reloaded.at_next_start().is_empty(), "its error says why, not 'at the next start'");
    assert_eq!(statuses(["sk-file", "sk-flag", "sk-next"]).await, [401, 200, 200], "the keys in use stay");
    let metrics = String::from_utf8(fleet.http.get(&fleet.url("/metrics")).await.body.to_vec()).unwrap();
    for line in [
        "kvroute_router_api_key_file_loads_total{outcome=\"loaded\"} 2",
        "kvroute_router_api_key_file_loads_total{outcome=\"refused\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} not in\n{metrics}");
    }

    let without = RouterConfig { api_key_file: None, ..keyed };
    let reloaded = reloader.apply(&fleet.router.state, &without).await;
    assert_eq!((reloaded.applied, reloaded.api_key_file), (vec!["api-key-file".into()], None));
    assert_eq!(statuses(["sk-file", "sk-flag", "sk-next"]).await, [401, 200, 401], "the file's keys dropped");

    // A new key with a first key file that cannot be read yet: the admission in force stays
    // whole, the new key waits with the file (it was said applied, and stuck once the file
    // could be read, the old key passing and the new one refused until a restart).
    let missing = dir.join("later");
    let rotated =
        RouterConfig { api_key: vec!["sk-new".into()], api_key_file: Some(missing.clone()), ..without };
    let reloaded = reloader.apply(&fleet.router.state, &rotated).await;
    assert!(reloaded.api_key_file.as_ref().unwrap().is_err());
    assert!(reloaded.applied.is_empty(), "{:?}", reloaded.applied);
    assert_eq!(reloaded.not_applied, ["api-key", "api-key-file"]);
    assert!(reloaded.at_next_start().is_empty(), "its error says why, not 'at the next start'");
    assert_eq!(statuses(["sk-flag", "sk-new", "sk-later"]).await, [200, 401, 401], "the admission in force");
    std::fs::write(&missing, "sk-later\n").unwrap();
    let reloaded = reloader.apply(&fleet.router.state, &rotated).await;
    assert_eq!(
        (reloaded.applied, reloaded.api_key_file),
        (vec!["api-key".into(), "api-key-file".into()], Some(Ok(1)))
    );
    assert_eq!(
        statuses(["sk-flag", "sk-new", "sk-later"]).await,
        [401, 200, 200],
        "the new keys, the old one revoked"
    );
    let _ = std::fs::remove_dir_all(dir);
}
