//! The replay client: asks a publisher's ROUTER socket for every buffered batch from a seq
//! on, over a fresh DEALER per request (a `zeromq` 0.7 DEALER never reconnects, and a
//! request sent to a dead peer vanishes without an error), with a timeout on the connect
//! and on every reply. Both reply layouts are accepted (`framing::decode_replay_reply`).

use std::time::Duration;

use bytes::Bytes;
use kvroute_proto::Seq;
use kvroute_proto::framing::{self, FrameError, LiveMessage, ReplayReply};
use zeromq::prelude::*;
use zeromq::{DealerSocket, SocketOptions, ZmqMessage};

/// Why a replay produced nothing usable.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplayError {
    #[error("replay socket {endpoint}: {source}")]
    Socket {
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
    #[error("replay from {endpoint} timed out")]
    Timeout { endpoint: String },
    #[error("malformed replay reply")]
    Malformed(#[from] FrameError),
    #[error("replay longer than {0} batches")]
    TooLong(usize),
}

/// Every buffered batch with seq >= `start`, in the order the publisher sent them.
pub(crate) async fn fetch(
    endpoint: &str,
    start: Seq,
    timeout: Duration,
    max_batches: usize,
) -> Result<Vec<LiveMessage>, ReplayError> {
    let socket_err = |source| ReplayError::Socket { endpoint: endpoint.to_owned(), source };
    let timed_out = || ReplayError::Timeout { endpoint: endpoint.to_owned() };
    let mut options = SocketOptions::default();
    options.connect_timeout(timeout);
    let mut dealer = DealerSocket::with_options(options);
    let result = async {
        tokio::time::timeout(timeout, dealer.connect(endpoint))
            .await
            .map_err(|_| timed_out())?
            .map_err(socket_err)?;
        let request: Vec<Bytes> = framing::encode_replay_request(start);
        let request = ZmqMessage::try_from(request).expect("a replay request has frames");
        dealer.send(request).await.map_err(socket_err)?;
        let mut batches = Vec::new();
        loop {
            let msg = tokio::time::timeout(timeout, dealer.recv())
                .await
                .map_err(|_| timed_out())?
                .map_err(socket_err)?;
            match framing::decode_replay_reply(&msg.into_vec())? {
                ReplayReply::End => return Ok(batches),
                ReplayReply::Batch(batch) if batches.len() < max_batches => batches.push(batch),
                ReplayReply::Batch(_) => return Err(ReplayError::TooLong(max_batches)),
            }
        }
    }
    .await;
    for e in dealer.close().await {
        tracing::debug!(error = %e, endpoint, "closing a replay socket");
    }
    result
}
