//! Starting an agent that cannot start.

use std::time::Duration;

use kvroute_replica_agent::config::Config;
use tokio_util::sync::CancellationToken;

/// An agent of two data-parallel ranks whose rank 1 event port is taken fails to start once
/// rank 0's event publisher runs: every task it had started ends (the publisher's, which
/// holds rank 0's event and replay ports), and the caller's token is left as it was.
#[tokio::test]
async fn a_start_that_fails_stops_what_it_started() {
    let runtime = tokio::runtime::Handle::current().metrics();
    let before = runtime.num_alive_tasks();
    // A free port whose next one is taken here: rank 0 binds, rank 1 cannot.
    let (rank_0, _taken) = (0..100)
        .find_map(|_| {
            let free = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
            let port = free.local_addr().ok()?.port();
            let next = std::net::TcpListener::bind(("127.0.0.1", port.checked_add(1)?)).ok()?;
            Some((port, next))
        })
        .expect("a free port with a free port after it");
    let config = Config {
        data_parallel_size: 2,
        events_endpoint: format!("tcp://127.0.0.1:{rank_0}"),
        ..Config::loopback("a")
    };
    let shutdown = CancellationToken::new();
    let failed = kvroute_replica_agent::start(config, shutdown.clone())
        .await
        .map(drop)
        .expect_err("the port is taken");
    let failed = format!("{failed:#}");
    assert!(failed.contains("binding the event sockets"), "{failed}");
    assert!(failed.contains(&format!("127.0.0.1:{}", rank_0 + 1)), "rank 1's port: {failed}");
    assert!(!shutdown.is_cancelled(), "the caller's token is the caller's");
    let ended = async {
        while runtime.num_alive_tasks() > before {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), ended).await.expect("every task the start began ends");
}
