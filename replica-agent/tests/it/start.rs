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
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let rank_0 = taken.local_addr().unwrap().port() - 1;
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
    assert!(format!("{failed:#}").contains("binding the event sockets"), "{failed:#}");
    assert!(!shutdown.is_cancelled(), "the caller's token is the caller's");
    let ended = async {
        while runtime.num_alive_tasks() > before {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), ended).await.expect("every task the start began ends");
}
