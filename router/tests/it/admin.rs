//! The admin gRPC service over real gRPC: listing, explaining, draining, removing, adding,
//! and the bearer token.

use kvroute_proto::pb::{self, router_admin_client::RouterAdminClient};
use serde_json::json;
use tonic::Request;

use crate::fleet::{FLEET_MODEL, Fleet, agent_config, replica_config};
use crate::support::wait_until;

fn body(prompt: &str) -> Vec<u8> {
    json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 1}).to_string().into_bytes()
}

const PROMPT: &str = "the admin service explains where this long enough prompt would go and why";

#[tokio::test]
async fn list_explain_drain_remove_and_add() {
    let fleet = Fleet::start(3).await;
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();

    let list = admin.list_replicas(pb::ListReplicasRequest {}).await.unwrap().into_inner();
    assert_eq!(list.replicas.len(), 3);
    for r in &list.replicas {
        assert_eq!(r.state, pb::StreamState::Exact as i32);
        assert!(r.healthy && !r.draining);
    }

    // Serve a prompt once; Explain then shows its overlap on the replica that cached it.
    let reply =
        fleet.http.post(&fleet.url("/v1/completions"), &serde_json::from_slice(&body(PROMPT)).unwrap()).await;
    let home = reply.header("x-kvroute-replica").unwrap().to_owned();
    let home_id = fleet.router.fleet().member(&home).unwrap().replica.id;
    let index = fleet.router.state.decider.index.clone();
    let blocks = fleet
        .router
        .state
        .decider
        .explain(kvroute_proto::openai::Endpoint::Completions, &body(PROMPT))
        .await
        .unwrap()
        .blocks;
    wait_until("events reach the index", || index.lookup(&blocks).get(home_id) == blocks.len()).await;
    let explain = admin
        .explain(pb::ExplainRequest { path: "/v1/completions".into(), body: body(PROMPT) })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(explain.chosen, home);
    assert_eq!(explain.policy, "cache-aware");
    assert_eq!(explain.candidates.len(), 3);
    let chosen = explain.candidates.iter().find(|c| c.replica == home).unwrap();
    assert_eq!(chosen.overlap_blocks, explain.request_blocks);
    assert!(explain.candidates.iter().all(|c| c.cost >= chosen.cost));
    let bad = admin.explain(pb::ExplainRequest { path: "/v1/completions".into(), body: b"{".to_vec() }).await;
    assert_eq!(bad.unwrap_err().code(), tonic::Code::InvalidArgument);
    // One the proxy takes, not on a prefix: said so, not refused as malformed.
    let embeds = br#"{"model":"m","prompt_embeds":"AAAAAAAAAAA="}"#.to_vec();
    let not_on_a_prefix =
        admin.explain(pb::ExplainRequest { path: "/v1/completions".into(), body: embeds }).await;
    let status = not_on_a_prefix.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("least-loaded"), "{status:?}");
    // Past the router's --max-completion-tokens (2^20 here), it is refused, as the proxy
    // refuses it.
    let over = br#"{"model":"m","prompt_embeds":"AAAAAAAAAAA=","max_tokens":2000000}"#.to_vec();
    let refused = admin.explain(pb::ExplainRequest { path: "/v1/completions".into(), body: over }).await;
    assert_eq!(refused.unwrap_err().code(), tonic::Code::InvalidArgument);

    // Draining the home replica sends the same prompt elsewhere.
    let drained = admin.drain(pb::DrainRequest { id: home.clone(), drain: true }).await.unwrap().into_inner();
    assert!(drained.draining);
    let reply =
        fleet.http.post(&fleet.url("/v1/completions"), &serde_json::from_slice(&body(PROMPT)).unwrap()).await;
    assert_eq!(reply.status, 200);
    assert_ne!(reply.header("x-kvroute-replica"), Some(home.as_str()));
    admin.drain(pb::DrainRequest { id: home.clone(), drain: false }).await.unwrap();

    // Removing frees its index entries; adding it back makes it routable again.
    let before = index.blocks(home_id);
    assert!(before > 0);
    let removed =
        admin.remove_replica(pb::RemoveReplicaRequest { id: home.clone() }).await.unwrap().into_inner();
    assert!(removed.removed);
    assert_eq!(removed.blocks_freed, before as u64);
    assert_eq!(index.blocks(home_id), 0);
    assert_eq!(admin.list_replicas(pb::ListReplicasRequest {}).await.unwrap().into_inner().replicas.len(), 2);
    let missing = admin.drain(pb::DrainRequest { id: home.clone(), drain: true }).await;
    assert_eq!(missing.unwrap_err().code(), tonic::Code::NotFound);

    let agent = fleet.agents.iter().flatten().find(|a| a.name == home).unwrap();
    let r = replica_config(agent);
    let spec = pb::ReplicaSpec {
        id: r.name,
        http_url: r.http,
        event_endpoint: r.events,
        replay_endpoint: r.replay.unwrap_or_default(),
        grpc_endpoint: r.grpc.unwrap_or_default(),
        engine: pb::EngineKind::Kvroute as i32,
        dp_size: 1,
        topic: String::new(),
        role: pb::ReplicaRole::Both as i32,
        bootstrap_port: 0,
    };
    admin.add_replica(pb::AddReplicaRequest { spec: Some(spec.clone()) }).await.unwrap();
    let fleet_handle = fleet.router.fleet().clone();
    wait_until("re-added replica syncs from its snapshot", || fleet_handle.ready()).await;
    assert!(index.blocks(home_id) > 0, "the snapshot restored its blocks");
    let dup = admin.add_replica(pb::AddReplicaRequest { spec: Some(spec.clone()) }).await;
    assert_eq!(dup.unwrap_err().code(), tonic::Code::AlreadyExists);
    // Another name and server on the same event stream would be credited with its cache.
    let copy = pb::ReplicaSpec {
        id: "copy".into(),
        http_url: crate::support::nowhere().replace("tcp", "http"),
        ..spec.clone()
    };
    let refused = admin.add_replica(pb::AddReplicaRequest { spec: Some(copy) }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::AlreadyExists, "{refused:?}");
    assert!(refused.message().contains("event stream"), "{refused:?}");
    assert!(fleet.router.fleet().member("copy").is_none());
    // A URL the proxy could not use is refused up front, not found out by clients' 503s.
    for http_url in ["http://", "http://127.0.0.1:8000 ", "http://127.0.0.1:99999"] {
        let bad = pb::ReplicaSpec { id: "bad-url".into(), http_url: http_url.into(), ..spec.clone() };
        let refused = admin.add_replica(pb::AddReplicaRequest { spec: Some(bad) }).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{http_url:?}: {refused:?}");
    }
    assert!(fleet.router.fleet().member("bad-url").is_none());
    // One without events is added predicted; a replay endpoint without events is refused.
    let predicted = pb::ReplicaSpec {
        id: "predicted".into(),
        http_url: crate::support::nowhere().replace("tcp", "http"),
        event_endpoint: String::new(),
        replay_endpoint: String::new(),
        grpc_endpoint: String::new(),
        ..spec.clone()
    };
    let replay = pb::ReplicaSpec {
        id: "replay".into(),
        replay_endpoint: spec.replay_endpoint.clone(),
        ..predicted.clone()
    };
    let added =
        admin.add_replica(pb::AddReplicaRequest { spec: Some(predicted) }).await.unwrap().into_inner();
    assert_eq!(added.state, pb::StreamState::Predicted as i32, "{added:?}");
    let refused = admin.add_replica(pb::AddReplicaRequest { spec: Some(replay) }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("needs an event endpoint"), "{refused:?}");
    // An engine kind this router does not know (a newer client's) is refused, not taken for
    // the default.
    let newer = pb::ReplicaSpec { id: "newer".into(), engine: 7, ..spec };
    let refused = admin.add_replica(pb::AddReplicaRequest { spec: Some(newer) }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(fleet.router.fleet().member("newer").is_none());
}

/// `n` agents behind a router routing with `policy`.
async fn fleet_with_policy(n: usize, policy: kvroute_router::policy::PolicyKind) -> Fleet {
    Fleet::with(n, agent_config, |c| kvroute_router::Config { policy, ..c }).await
}

/// Two replicas, agent-0 drained through the admin service: the fleet, an admin client, the
/// router's fleet and agent-0's spec.
async fn agent_0_drained() -> (
    Fleet,
    RouterAdminClient<tonic::transport::Channel>,
    kvroute_router::fleet::Fleet,
    kvroute_router::replicas::ReplicaSpec,
) {
    let fleet = Fleet::start(2).await;
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    let router_fleet = fleet.router.fleet().clone();
    let agent = fleet.agents.iter().flatten().find(|a| a.name == "agent-0").unwrap();
    let spec = replica_config(agent).to_spec(crate::fleet::FLEET_MODEL, crate::fleet::FLEET_BLOCK);
    admin.drain(pb::DrainRequest { id: "agent-0".into(), drain: true }).await.unwrap();
    (fleet, admin, router_fleet, spec)
}

/// A `RemoveReplica` cut short while it waits (its deadline passed, its client went away)
/// still removes the replica, in the background; the drain goes with it, so a replica added
/// under the name later serves.
#[tokio::test]
async fn a_removal_cut_short_takes_its_drain_with_it() {
    use futures::FutureExt;
    use kvroute_proto::pb::router_admin_server::RouterAdmin;
    let (fleet, _admin, router_fleet, spec) = agent_0_drained().await;
    let service = kvroute_router::admin::AdminService::new(
        fleet.router.state.clone(),
        crate::fleet::FLEET_MODEL.into(),
        crate::fleet::FLEET_BLOCK,
    );
    let call = service.remove_replica(Request::new(pb::RemoveReplicaRequest { id: "agent-0".into() }));
    assert!(call.now_or_never().is_none(), "cut short while the replica's tasks stop");
    let ingest = router_fleet.ingest().clone();
    wait_until("the removal completes on its own", || ingest.replicas().by_name("agent-0").is_none()).await;
    router_fleet.add(spec).unwrap();
    assert!(!router_fleet.member("agent-0").unwrap().upstream.is_draining(), "a new replica under the name");
}

#[tokio::test]
async fn a_token_protects_the_admin_service() {
    let fleet =
        Fleet::with(1, agent_config, |c| kvroute_router::Config { admin_token: Some("s3cret".into()), ..c })
            .await;
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    let denied = admin.list_replicas(pb::ListReplicasRequest {}).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::Unauthenticated);
    let mut wrong = Request::new(pb::ListReplicasRequest {});
    wrong.metadata_mut().insert("authorization", "Bearer nope".parse().unwrap());
    assert_eq!(admin.list_replicas(wrong).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    let mut right = Request::new(pb::ListReplicasRequest {});
    right.metadata_mut().insert("authorization", "Bearer s3cret".parse().unwrap());
    assert_eq!(admin.list_replicas(right).await.unwrap().into_inner().replicas.len(), 1);
    // The scheme's name is case-insensitive (RFC 9110 §11.1).
    let mut lower = Request::new(pb::ListReplicasRequest {});
    lower.metadata_mut().insert("authorization", "bearer s3cret".parse().unwrap());
    assert_eq!(admin.list_replicas(lower).await.unwrap().into_inner().replicas.len(), 1);
}

#[test]
fn the_admin_service_beyond_loopback_needs_a_token() {
    let config = kvroute_router::Config {
        admin_listen: "0.0.0.0:0".parse().unwrap(),
        ..kvroute_router::Config::default()
    };
    assert!(config.validate().is_err());
    let config = kvroute_router::Config { admin_token: Some("t".into()), ..config };
    assert_eq!(config.validate(), Ok(()));
}

/// `/ready` stays true once the first sync is done: a replica added later whose events never
/// arrive is routed on load alone, and does not take the router out of its Service.
#[tokio::test]
async fn a_replica_added_later_does_not_unready_the_router() {
    let fleet = Fleet::start(1).await;
    assert_eq!(fleet.http.get(&fleet.url("/ready")).await.status, 200);
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    let silent = pb::ReplicaSpec {
        id: "silent".into(),
        http_url: format!("http://127.0.0.1:{}", kvroute_proto::loopback_port::unused().unwrap()),
        event_endpoint: crate::support::nowhere(),
        engine: pb::EngineKind::Kvroute as i32,
        dp_size: 1,
        ..Default::default()
    };
    admin.add_replica(pb::AddReplicaRequest { spec: Some(silent) }).await.unwrap();
    assert!(!fleet.router.fleet().ready(), "the new replica has not synced");
    assert_eq!(fleet.http.get(&fleet.url("/ready")).await.status, 200);
}

/// `Explain` leaves the policy's turn where it is: round-robin still alternates between the
/// requests actually sent, however many explanations come in between.
#[tokio::test]
async fn explaining_does_not_move_round_robin_on() {
    let fleet = fleet_with_policy(2, kvroute_router::policy::PolicyKind::RoundRobin).await;
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    let mut homes = Vec::new();
    for _ in 0..4 {
        let explain = admin
            .explain(pb::ExplainRequest { path: "/v1/completions".into(), body: body(PROMPT) })
            .await
            .unwrap()
            .into_inner();
        let reply = fleet
            .http
            .post(&fleet.url("/v1/completions"), &serde_json::from_slice(&body(PROMPT)).unwrap())
            .await;
        let home = reply.header("x-kvroute-replica").unwrap().to_owned();
        assert_eq!(explain.chosen, home, "the explanation foretold the next choice");
        homes.push(home);
    }
    assert!(homes.windows(2).all(|w| w[0] != w[1]), "turns alternate: {homes:?}");
}

/// Prompts that share every full block and differ only in their partial last one spread over
/// an idle fleet too: the tie key covers the whole prompt.
#[tokio::test]
async fn prompts_differing_in_their_last_partial_block_spread() {
    let fleet = fleet_with_policy(4, kvroute_router::policy::PolicyKind::LeastLoaded).await;
    let decider = &fleet.router.state.decider;
    let mut chosen = std::collections::HashSet::new();
    for k in 0..40u32 {
        // Eight full blocks of 4, then three tokens of their own.
        let prompt: Vec<u32> = (1..=32).chain([100 + k, 200 + k, 300 + k]).collect();
        let body = serde_json::to_vec(&serde_json::json!({"prompt": prompt, "max_tokens": 1})).unwrap();
        let plan = decider.explain(kvroute_proto::openai::Endpoint::Completions, &body).await.unwrap();
        chosen.insert(plan.chosen().unwrap().member.replica.spec.name.clone());
    }
    assert_eq!(chosen.len(), 4, "{chosen:?}");
}

/// Requests deciding at once that share a new prefix (a system prompt not yet cached) go
/// where the first of them went: each decision sees the credits of the one before it. Two
/// threads deciding together both saw none, and their requests went to different replicas,
/// each to prefill the prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_deciding_at_once_on_a_new_prefix_go_together() {
    let fleet = Fleet::start(4).await;
    let shared: String = (0..400).map(|w| format!("system{w} ")).collect();
    for round in 0..4 {
        let decisions: Vec<_> = (0..32)
            .map(|i| {
                let (state, body) =
                    (fleet.router.state.clone(), body(&format!("{round}{shared} user question {i}")));
                tokio::spawn(async move {
                    let plan = state.decider.decide(kvroute_proto::openai::Endpoint::Completions, &body);
                    plan.await.unwrap().chosen().unwrap().member.replica.spec.name.clone()
                })
            })
            .collect();
        let chosen: std::collections::HashSet<String> =
            futures::future::join_all(decisions).await.into_iter().map(Result::unwrap).collect();
        assert_eq!(chosen.len(), 1, "round {round}: {chosen:?}");
    }
}

/// A request's retries go to the replicas it did not choose in its own rendezvous order when
/// their costs tie (the random policy's others): not to the lowest id every time, which would
/// pile a failed replica's traffic onto one other.
#[tokio::test]
async fn tied_retries_spread_over_the_fleet() {
    let fleet = fleet_with_policy(4, kvroute_router::policy::PolicyKind::Random).await;
    let decider = &fleet.router.state.decider;
    let mut seconds = std::collections::HashSet::new();
    for i in 0..64 {
        let body = body(&format!("w{i} {PROMPT}"));
        let plan = decider.decide(kvroute_proto::openai::Endpoint::Completions, &body).await.unwrap();
        let costs: Vec<f64> = plan.order().skip(1).map(|s| s.cost).collect();
        assert!(costs.windows(2).all(|w| w[0] <= w[1]), "by cost first: {costs:?}");
        seconds.insert(plan.order().nth(1).unwrap().member.replica.spec.name.clone());
    }
    assert_eq!(seconds.len(), 4, "every replica is someone's second: {seconds:?}");
}

/// A drain outlasts the replica's entry: a replica replaced under the same name (a pod back
/// under a new address) or removed and added again stays drained until it is undrained.
#[tokio::test]
async fn a_drain_outlasts_the_replicas_entry() {
    let (_fleet, mut admin, router_fleet, spec) = agent_0_drained().await;

    let mut moved = spec.clone();
    moved.topic = "moved".into();
    router_fleet.upsert(moved).await.unwrap();
    let replaced = router_fleet.member("agent-0").unwrap();
    assert_eq!(replaced.replica.spec.topic, "moved", "the entry was replaced");
    assert!(replaced.upstream.is_draining(), "still drained after the replacement");

    router_fleet.remove("agent-0").await.unwrap();
    router_fleet.add(spec.clone()).unwrap();
    assert!(router_fleet.member("agent-0").unwrap().upstream.is_draining(), "still drained when added again");

    admin.drain(pb::DrainRequest { id: "agent-0".into(), drain: false }).await.unwrap();
    router_fleet.remove("agent-0").await.unwrap();
    router_fleet.add(spec.clone()).unwrap();
    assert!(!router_fleet.member("agent-0").unwrap().upstream.is_draining(), "undrained for good");

    // Undrained while it is out of the fleet (a pod being rescheduled), it comes back serving.
    admin.drain(pb::DrainRequest { id: "agent-0".into(), drain: true }).await.unwrap();
    router_fleet.remove("agent-0").await.unwrap();
    let absent = admin.drain(pb::DrainRequest { id: "agent-0".into(), drain: false }).await.unwrap_err();
    assert_eq!(absent.code(), tonic::Code::NotFound);
    router_fleet.add(spec.clone()).unwrap();
    assert!(!router_fleet.member("agent-0").unwrap().upstream.is_draining(), "the drain was lifted");

    // Drained while it is out of the fleet, it comes back drained; a name never in the fleet
    // (a typo) keeps no drain.
    router_fleet.remove("agent-0").await.unwrap();
    let kept = admin.drain(pb::DrainRequest { id: "agent-0".into(), drain: true }).await.unwrap_err();
    assert_eq!(kept.code(), tonic::Code::NotFound);
    assert!(kept.message().contains("kept for the name"), "{}", kept.message());
    router_fleet.add(spec.clone()).unwrap();
    assert!(router_fleet.member("agent-0").unwrap().upstream.is_draining(), "drained while it was out");
    let typo = admin.drain(pb::DrainRequest { id: "agent-O".into(), drain: true }).await.unwrap_err();
    assert!(!typo.message().contains("kept"), "{}", typo.message());
    assert!(!router_fleet.knows("agent-O"));

    // Removed through the admin service, a replica is gone for good, drain and all.
    admin.drain(pb::DrainRequest { id: "agent-0".into(), drain: true }).await.unwrap();
    let removed = admin.remove_replica(pb::RemoveReplicaRequest { id: "agent-0".into() }).await.unwrap();
    assert!(removed.get_ref().removed && removed.get_ref().drain_lifted, "{removed:?}");
    router_fleet.add(spec.clone()).unwrap();
    assert!(!router_fleet.member("agent-0").unwrap().upstream.is_draining(), "a new replica under the name");

    // Removing a name out of the fleet lifts the drain kept for it, and says so: it used to
    // answer only `removed: false` (the CLI: "no replica named"), the drain silently gone.
    admin.drain(pb::DrainRequest { id: "agent-0".into(), drain: true }).await.unwrap();
    router_fleet.remove("agent-0").await.unwrap();
    let removed = admin.remove_replica(pb::RemoveReplicaRequest { id: "agent-0".into() }).await.unwrap();
    assert!(!removed.get_ref().removed && removed.get_ref().drain_lifted, "{removed:?}");
    let again = admin.remove_replica(pb::RemoveReplicaRequest { id: "agent-0".into() }).await.unwrap();
    assert!(!again.get_ref().removed && !again.get_ref().drain_lifted, "{again:?}");
    let empty = admin.remove_replica(pb::RemoveReplicaRequest { id: String::new() }).await.unwrap_err();
    assert_eq!(empty.code(), tonic::Code::InvalidArgument);
}

/// Regression: `Explain` kept tonic's 4 MiB message limit, and refused (`OUT_OF_RANGE`)
/// a long prompt the proxy routes, up to `--max-body-bytes` (32 MiB by default).
#[tokio::test]
async fn explain_takes_every_body_the_proxy_takes() {
    let fleet = Fleet::start(1).await;
    let limit = fleet.router.state.forward.max_body_bytes;
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url())
        .await
        .unwrap()
        .max_encoding_message_size(usize::MAX);
    let long = body(&"word ".repeat(5 << 20 >> 2));
    assert!(long.len() > 4 << 20 && long.len() < limit, "{} bytes", long.len());
    let explained = admin.explain(pb::ExplainRequest { path: "/v1/completions".into(), body: long }).await;
    // What the proxy would answer: a decision, or its 400 for the prompt's length.
    match explained {
        Ok(_) => {}
        Err(s) => assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}"),
    }
}

/// `kvroute-admin` ([`kvroute_router::admin_cli`]) against a router's admin service: what it
/// prints, and what it changes, through real gRPC; a wrong token or a replica not in the fleet
/// is an error.
#[tokio::test]
async fn the_admin_command_lists_drains_resumes_explains_and_removes() {
    use clap::Parser;
    use kvroute_router::admin_cli::{Cli, Command, Output, run};
    let fleet =
        Fleet::with(3, agent_config, |c| kvroute_router::Config { admin_token: Some("s3cret".into()), ..c })
            .await;
    let url = fleet.router.admin_url();
    let cli = |command| Cli {
        url: url.clone(),
        token: Some("s3cret".into()),
        ca_cert: None,
        server_name: None,
        client_cert: None,
        client_key: None,
        output: Output::Table,
        command,
    };
    let said = async |cli: Cli| {
        let mut out = Vec::new();
        run(&cli, &mut out).await.map(|()| String::from_utf8(out).unwrap()).map_err(|e| format!("{e:#}"))
    };
    let line = |out: &str, replica: &str| {
        out.lines().find(|l| l.starts_with(replica)).unwrap_or_default().to_owned()
    };

    let listed = said(cli(Command::List)).await.unwrap();
    for name in ["agent-0", "agent-1", "agent-2"] {
        assert!(line(&listed, name).contains(" exact "), "{listed}");
        assert!(line(&listed, name).contains(" yes "), "{listed}");
    }
    let upstream = |name: &str| fleet.router.fleet().member(name).unwrap().upstream.clone();
    let drained = said(cli(Command::Drain { replica: "agent-1".into() })).await.unwrap();
    assert!(line(&drained, "agent-1").contains(" draining "), "{drained}");
    assert!(upstream("agent-1").is_draining());
    let resumed = said(cli(Command::Resume { replica: "agent-1".into() })).await.unwrap();
    assert!(line(&resumed, "agent-1").contains(" yes "), "{resumed}");
    assert!(!upstream("agent-1").is_draining());

    let prompt = String::from_utf8(body(PROMPT)).unwrap();
    let explain = Command::Explain { path: "/v1/completions".into(), body: prompt.clone() };
    let explained = said(cli(explain)).await.unwrap();
    let chosen = explained.lines().next().unwrap();
    assert!(chosen.starts_with("chosen agent-") && chosen.contains("by cache-aware"), "{explained}");
    assert_eq!(explained.lines().filter(|l| l.starts_with("agent-")).count(), 3, "{explained}");
    let bad = said(cli(Command::Explain { path: "/v1/completions".into(), body: "{".into() })).await;
    assert!(bad.is_err(), "a malformed body");

    let gone = fleet.router.fleet().member("agent-2").unwrap().replica.spec.clone();
    let removed = said(cli(Command::Remove { replica: "agent-2".into() })).await.unwrap();
    assert!(removed.starts_with("removed agent-2"), "{removed}");
    assert!(fleet.router.fleet().member("agent-2").is_none());
    assert!(said(cli(Command::Remove { replica: "agent-2".into() })).await.is_err(), "gone already");
    // A drain of a name the router knows, out of the fleet now, is kept for its return: said,
    // and no error. One of a name it never knew is.
    let kept = said(cli(Command::Drain { replica: "agent-2".into() })).await.unwrap();
    assert!(kept.contains(kvroute_router::admin::DRAIN_KEPT), "{kept}");
    let lifted = said(cli(Command::Resume { replica: "agent-2".into() })).await.unwrap();
    assert!(lifted.contains(kvroute_router::admin::DRAIN_LIFTED), "{lifted}");
    let unknown = said(cli(Command::Drain { replica: "agent-9".into() })).await.unwrap_err();
    assert_eq!(unknown, "the router answered NotFound: no replica named \"agent-9\"");
    // So is a resume of a name with no drain kept (a typo), and of one lifted already.
    for name in ["agent-9", "agent-2"] {
        let unknown = said(cli(Command::Resume { replica: name.into() })).await.unwrap_err();
        assert_eq!(unknown, format!("the router answered NotFound: no replica named {name:?}"));
    }

    // Back in as `--replica` names it, and the answers as JSON, from the command line.
    let json = async |args: &[&str]| {
        let mut line = vec!["kvroute-admin", "--url", &url, "--token", "s3cret", "--output", "json"];
        line.extend(args);
        let out = said(Cli::try_parse_from(line).unwrap()).await?;
        Ok::<_, String>(serde_json::from_str::<serde_json::Value>(&out).unwrap())
    };
    let spec = format!(
        "name=agent-2,http={},events={},replay={},grpc={}",
        gone.http_url,
        gone.event_endpoint,
        gone.replay_endpoint.as_deref().unwrap(),
        gone.grpc_endpoint.as_deref().unwrap()
    );
    let added = json(&["add", &spec]).await.unwrap();
    assert_eq!(added["spec"]["id"], "agent-2", "{added}");
    assert_eq!(added["spec"]["http_url"], gone.http_url.as_str(), "{added}");
    assert_eq!(added["spec"]["engine"], "kvroute", "{added}");
    assert_eq!(added["spec"]["role"], "both", "{added}");
    assert!(fleet.router.fleet().member("agent-2").is_some());
    let again = json(&["add", &spec]).await.unwrap_err();
    assert!(again.starts_with("the router answered AlreadyExists"), "{again}");
    let listed = json(&["list"]).await.unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 3, "{listed:?}");
    let agent0 = listed.iter().find(|r| r["spec"]["id"] == "agent-0").unwrap();
    assert_eq!(agent0["state"], "exact", "{agent0}");
    assert_eq!(agent0["healthy"], true, "{agent0}");
    let explained = json(&["explain", &prompt]).await.unwrap();
    let candidates = explained["candidates"].as_array().unwrap();
    assert!(candidates.iter().any(|c| c["replica"] == explained["chosen"]), "{explained}");
    assert_eq!(candidates.len(), 3, "{explained}");

    let stranger = Cli { token: Some("nope".into()), ..cli(Command::List) };
    let refused = said(stranger).await.unwrap_err();
    assert!(refused.contains("a valid bearer token is required"), "{refused}");
    let nowhere = format!("http://127.0.0.1:{}", kvroute_proto::loopback_port::unused().unwrap());
    let unreachable = said(Cli { url: nowhere, ..cli(Command::List) }).await.unwrap_err();
    assert!(unreachable.contains("cannot be reached"), "{unreachable}");
}

/// The `kvroute-admin` binary: a bad flag or a router it cannot reach exits non-zero, saying why.
#[test]
fn the_admin_binary_exits_non_zero_with_a_message() {
    let admin = env!("CARGO_BIN_EXE_kvroute-admin");
    let bad = std::process::Command::new(admin).args(["--no-such-flag", "list"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--no-such-flag"));
    let port = kvroute_proto::loopback_port::unused().unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let down = std::process::Command::new(admin).args(["--url", &url, "list"]).output().unwrap();
    assert_eq!(down.status.code(), Some(1));
    let said = String::from_utf8_lossy(&down.stderr);
    assert!(said.starts_with("kvroute-admin: ") && said.contains("cannot be reached"), "{said}");
}
