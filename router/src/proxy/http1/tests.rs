use super::*;
use http::StatusCode;

use super::head::MAX_HEADERS;

fn head(text: &str) -> Head {
    head_for(text, &Method::POST)
}

fn head_for(text: &str, method: &Method) -> Head {
    let (length, head) = parse_head(text.as_bytes(), method).unwrap().expect("complete");
    assert_eq!(length, text.len());
    head
}

#[test]
fn framing_follows_rfc_9112() {
    assert_eq!(head("HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n").framing, Framing::Length(12));
    assert_eq!(head("HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n").framing, Framing::Chunked);
    assert_eq!(head("HTTP/1.1 200 OK\r\n\r\n").framing, Framing::UntilClose);
    assert_eq!(head("HTTP/1.1 204 No Content\r\n\r\n").framing, Framing::Length(0));
    assert_eq!(head("HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n").framing, Framing::Length(0));
    let to_head = head_for("HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n", &Method::HEAD);
    assert_eq!(to_head.framing, Framing::Length(0));
    let two = head("HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 3\r\n\r\n");
    assert_eq!(two.framing, Framing::Length(3));
}

/// Transfer-Encoding overrides Content-Length, which must not reach the client beside a
/// de-chunked body; such a reply's connection is not reused.
#[test]
fn content_length_beside_chunked_is_dropped() {
    let both = head("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n");
    assert_eq!(both.framing, Framing::Chunked);
    assert!(!both.parts.headers.contains_key(header::CONTENT_LENGTH));
    assert!(!both.keep_alive);
}

#[test]
fn keep_alive_needs_http_1_1_no_close_and_a_delimited_body() {
    assert!(head("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").keep_alive);
    assert!(
        !head("HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\ncontent-length: 0\r\n\r\n").keep_alive
    );
    assert!(!head("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n").keep_alive);
    assert!(!head("HTTP/1.1 200 OK\r\n\r\n").keep_alive, "delimited by close");
    // A byte that is not UTF-8 elsewhere in the value does not hide its `close`.
    let text = b"HTTP/1.1 200 OK\r\nConnection: close, x-\xff\r\ncontent-length: 0\r\n\r\n";
    let (_, head) = parse_head(text, &Method::POST).unwrap().expect("complete");
    assert!(!head.keep_alive);
}

#[test]
fn heads_are_parsed_whole_or_not_at_all() {
    let text = "HTTP/1.1 201 Created\r\nx-a: 1\r\nx-a: 2\r\ncontent-type: text/event-stream\r\n\r\nbody";
    for cut in 0..text.len() - 4 {
        assert!(parse_head(&text.as_bytes()[..cut], &Method::POST).unwrap().is_none(), "cut at {cut}");
    }
    let (length, head) = parse_head(text.as_bytes(), &Method::POST).unwrap().unwrap();
    assert_eq!(&text[length..], "body");
    assert_eq!(head.parts.status, StatusCode::CREATED);
    let values: Vec<_> = head.parts.headers.get_all("x-a").iter().collect();
    assert_eq!(values, ["1", "2"], "repeated headers kept in order");
}

#[test]
fn values_are_kept_exactly_even_empty_and_more_than_a_hundred_fields_are_refused() {
    let h = head("HTTP/1.1 200 OK\r\nx-empty:\r\nx-b:  spaced out \r\ncontent-length: 0\r\n\r\n");
    assert_eq!(h.parts.headers["x-empty"], "");
    assert_eq!(h.parts.headers["x-b"], "spaced out");
    let fields = |n: usize| -> String { (0..n).map(|i| format!("x-h{i}: {i}\r\n")).collect() };
    let at_limit = format!("HTTP/1.1 200 OK\r\n{}\r\n", fields(MAX_HEADERS));
    assert_eq!(head(&at_limit).parts.headers.len(), MAX_HEADERS);
    let over = format!("HTTP/1.1 200 OK\r\n{}\r\n", fields(MAX_HEADERS + 1));
    assert!(matches!(parse_head(over.as_bytes(), &Method::POST), Err(WireError::Malformed(_))));
}

#[test]
fn malformed_heads_are_errors() {
    for text in [
        "HTTP/1.1 20 OK\r\n\r\n",
        "SMTP 220 hello\r\n\r\n",
        "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        "HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
        "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n",
        "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
        "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
        // Faulty framing (RFC 9112 §6.1).
        "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
    ] {
        assert!(
            matches!(parse_head(text.as_bytes(), &Method::POST), Err(WireError::Malformed(_))),
            "{text:?}"
        );
    }
}

mod on_a_socket {
    use std::sync::Arc;
    use std::time::Duration;

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::Semaphore;

    use super::*;
    use crate::proxy::body::full;
    use crate::proxy::pool::{Pool, SendError};

    /// What a raw replica does with the `n`th request on a connection.
    type Script = fn(usize) -> Reply;

    enum Reply {
        Answer(&'static [u8]),
        /// In one write, so the proxy reads it whole.
        AnswerAtOnce(&'static [u8]),
        AnswerAndClose(&'static [u8]),
        Close,
    }
    use Reply::*;

    /// A replica on 127.0.0.1 that reads requests (heads and `Content-Length` or chunked
    /// bodies, through `httparse`) and writes its script's answers a byte at a time, so the
    /// proxy reads them in pieces. Returns its URL, the requests' raw bytes, and a permit
    /// for each connection it has closed.
    async fn raw_replica(script: Script) -> (String, Arc<std::sync::Mutex<Vec<Vec<u8>>>>, Arc<Semaphore>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let closed = Arc::new(Semaphore::new(0));
        let (log, closing) = (seen.clone(), closed.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                stream.set_nodelay(true).unwrap();
                let (log, closing) = (log.clone(), closing.clone());
                tokio::spawn(async move {
                    serve(stream, script, &log).await;
                    closing.add_permits(1);
                });
            }
        });
        (url, seen, closed)
    }

    /// Serves one connection by `script` until it closes (`stream` is dropped on return).
    async fn serve(mut stream: TcpStream, script: Script, log: &std::sync::Mutex<Vec<Vec<u8>>>) {
        let mut n = 0;
        while let Some(request) = read_request(&mut stream).await {
            log.lock().unwrap().push(request);
            let (answer, close) = match script(n) {
                AnswerAtOnce(bytes) => {
                    stream.write_all(bytes).await.unwrap();
                    n += 1;
                    continue;
                }
                Answer(bytes) => (bytes, false),
                AnswerAndClose(bytes) => (bytes, true),
                Close => return,
            };
            for byte in answer {
                if stream.write_all(&[*byte]).await.is_err() {
                    return;
                }
                tokio::task::yield_now().await;
            }
            if close {
                return;
            }
            n += 1;
        }
    }

    /// One request's bytes, or `None` at the end of the connection.
    async fn read_request(stream: &mut TcpStream) -> Option<Vec<u8>> {
        let mut buf = Vec::new();
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut request = httparse::Request::new(&mut headers);
            if let Ok(httparse::Status::Complete(head)) = request.parse(&buf) {
                let get = |name: &str| {
                    request
                        .headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .map(|h| h.value.to_vec())
                };
                let length: usize =
                    get("content-length").map_or(0, |v| String::from_utf8(v).unwrap().parse().unwrap());
                let chunked = get("transfer-encoding").is_some();
                loop {
                    let body = &buf[head..];
                    let done = if chunked { body.ends_with(b"0\r\n\r\n") } else { body.len() >= length };
                    if done {
                        return Some(buf);
                    }
                    if read_more(stream, &mut buf).await == 0 {
                        return None;
                    }
                }
            }
            if read_more(stream, &mut buf).await == 0 {
                return None;
            }
        }
    }

    async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> usize {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await.unwrap_or(0);
        buf.extend_from_slice(&chunk[..n]);
        n
    }

    fn pool() -> Arc<Pool> {
        Arc::new(Pool::new(Duration::from_secs(2), Duration::from_secs(60), 8))
    }

    fn post(url: &str, body: Outgoing) -> http::Request<Outgoing> {
        http::Request::post(format!("{url}/v1/completions")).header("x-kept", "1").body(body).unwrap()
    }

    /// Sends a request and reads the whole response body.
    async fn exchange(
        pool: &Arc<Pool>,
        request: http::Request<Outgoing>,
    ) -> Result<(StatusCode, Vec<u8>), BoxError> {
        let response = pool.send(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        Ok((status, body.to_vec()))
    }

    const CHUNKED: &[u8] =
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n\
        6;ext=1\r\ndata: \r\n10\r\n{\"cached_tokens\"\r\n3\r\n:7}\r\n0\r\nx-trailer: t\r\n\r\n";

    #[tokio::test]
    async fn chunked_bodies_are_dechunked_and_their_connection_reused() {
        let (url, seen, _) = raw_replica(|_| Answer(CHUNKED)).await;
        let pool = pool();
        for _ in 0..3 {
            let (status, body) =
                exchange(&pool, post(&url, Outgoing::Full(Bytes::from_static(b"{}")))).await.unwrap();
            assert_eq!(status, StatusCode::OK);
            assert_eq!(body, b"data: {\"cached_tokens\":7}");
            assert_eq!(pool.idle_count(), 1, "back in the pool after its trailers");
        }
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 3, "three requests on one connection");
        let first = String::from_utf8_lossy(&seen[0]);
        assert!(first.starts_with("POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:"), "{first}");
        assert!(first.contains("x-kept: 1\r\n") && first.ends_with("content-length: 2\r\n\r\n{}"), "{first}");
    }

    /// A chunk size may have any number of leading zeros (`1*HEXDIG`); httparse reads 16
    /// digits at most, and the body was cut off as malformed.
    #[tokio::test]
    async fn chunk_sizes_with_leading_zeros_are_read() {
        let (url, _, _) = raw_replica(|_| {
            Answer(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
                00000000000000000006\r\nhello \r\n0a\r\n0123456789\r\n00000000000000000000\r\n\r\n",
            )
        })
        .await;
        let pool = pool();
        let (status, body) =
            exchange(&pool, post(&url, Outgoing::Full(Bytes::from_static(b"{}")))).await.unwrap();
        assert_eq!((status, body.as_slice()), (StatusCode::OK, b"hello 0123456789".as_slice()));
        assert_eq!(pool.idle_count(), 1, "back in the pool after its last chunk");
    }

    #[tokio::test]
    async fn interim_responses_are_skipped_and_lengths_followed() {
        let (url, _, _) = raw_replica(|_| {
            Answer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 5\r\n\r\nhello")
        })
        .await;
        let pool = pool();
        for _ in 0..2 {
            let answer = exchange(&pool, post(&url, Outgoing::Full(Bytes::new()))).await.unwrap();
            assert_eq!(answer, (StatusCode::CREATED, b"hello".to_vec()));
        }
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_body_delimited_by_close_is_read_to_the_end_and_not_pooled() {
        let (answer, idle) = post_once(|_| AnswerAndClose(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")).await;
        assert_eq!(answer, (StatusCode::OK, b"until the end".to_vec()));
        assert_eq!(idle, 0);
    }

    /// One empty POST to a raw replica following `script`: its answer, and the idle
    /// connections the pool holds after it.
    async fn post_once(script: Script) -> ((StatusCode, Vec<u8>), usize) {
        let (url, _, _) = raw_replica(script).await;
        let pool = pool();
        let answer = exchange(&pool, post(&url, Outgoing::Full(Bytes::new()))).await.unwrap();
        (answer, pool.idle_count())
    }

    #[tokio::test]
    async fn truncated_bodies_are_errors_and_their_connection_closed() {
        let (url, _, _) =
            raw_replica(|_| AnswerAndClose(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort")).await;
        let pool = pool();
        let response = pool.send(post(&url, Outgoing::Full(Bytes::new()))).await.unwrap();
        let mut body = response.into_body();
        let mut read = Vec::new();
        let error = loop {
            match body.frame().await {
                Some(Ok(frame)) => read.extend_from_slice(frame.data_ref().unwrap()),
                Some(Err(e)) => break e,
                None => panic!("a truncated body ended cleanly"),
            }
        };
        assert_eq!(read, b"short");
        assert!(
            error.downcast_ref::<BodyError>().is_some_and(|e| matches!(e, BodyError::Truncated)),
            "{error}"
        );
        assert_eq!(pool.idle_count(), 0);
    }

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    /// A replica may close an idle connection just as a request goes out on it. The request,
    /// a POST too, goes out once more on a new connection to the same replica.
    #[tokio::test]
    async fn a_request_goes_out_again_on_a_connection_closed_under_it() {
        let (url, seen, _) = raw_replica(|n| if n == 0 { Answer(OK) } else { Close }).await;
        let pool = pool();
        let get =
            || http::Request::get(format!("{url}/v1/models")).body(Outgoing::Full(Bytes::new())).unwrap();
        for _ in 0..3 {
            assert_eq!(exchange(&pool, get()).await.unwrap(), (StatusCode::OK, b"ok".to_vec()));
        }
        assert_eq!(seen.lock().unwrap().len(), 5, "three answered, two closed without an answer");
        let request = post(&url, Outgoing::Full(Bytes::from_static(b"{}")));
        assert_eq!(exchange(&pool, request).await.unwrap(), (StatusCode::OK, b"ok".to_vec()));
        assert_eq!(seen.lock().unwrap().len(), 7, "the POST went out twice: closed, then answered");
        // A new connection that fails is the caller's to handle: nothing is sent a third time.
        let (url, seen, _) = raw_replica(|_| Close).await;
        let failed = pool.send(post(&url, Outgoing::Full(Bytes::from_static(b"{}")))).await;
        assert!(matches!(failed, Err(SendError::Wire(WireError::ClosedBeforeAnswer))), "{:?}", failed.err());
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    /// A pooled connection that fails with the request, to a replica that takes no new one
    /// (its process gone), is no connection (another replica may be tried), and the error
    /// says the replica may have had the request: a decode with a remote prefill's params is
    /// then not sent elsewhere with them.
    #[tokio::test]
    async fn a_pooled_failure_then_no_connection_says_the_replica_may_have_had_it() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            drop(listener);
            serve(stream, |n| if n == 0 { Answer(OK) } else { Close }, &log).await;
        });
        let pool = pool();
        let request = || post(&url, Outgoing::Full(Bytes::from_static(b"{}")));
        assert_eq!(exchange(&pool, request()).await.unwrap(), (StatusCode::OK, b"ok".to_vec()));
        let (parts, body) = request().into_parts();
        let failed = pool.send_or_give_back(&parts.method, &parts.uri, &parts.headers, body).await;
        let Err(crate::proxy::pool::Unsent::NotConnected(error, _)) = failed else {
            panic!("not connected again");
        };
        assert!(matches!(&error, SendError::Resent { first: WireError::ClosedBeforeAnswer, .. }), "{error}");
        assert!(!error.sent_nothing());
        assert_eq!(seen.lock().unwrap().len(), 2, "the second went out on the pooled connection");
    }

    /// A replica that sends an interim answer (`100 Continue`) and closes has answered
    /// nothing: the request is one that may go elsewhere, not a malformed answer (which it
    /// would have run).
    #[tokio::test]
    async fn an_interim_answer_then_a_close_is_no_answer() {
        let (url, _, _) = raw_replica(|_| AnswerAndClose(b"HTTP/1.1 100 Continue\r\n\r\n")).await;
        let failed = pool().send(post(&url, Outgoing::Full(Bytes::from_static(b"{}")))).await;
        assert!(matches!(failed, Err(SendError::Wire(WireError::ClosedBeforeAnswer))), "{:?}", failed.err());
    }

    /// Other interim answers (`103 Early Hints`) say the replica has the request under way:
    /// a close after one may have run it, so the request is not one to send again.
    #[tokio::test]
    async fn an_early_hint_then_a_close_is_not_sent_again() {
        let (url, _, _) =
            raw_replica(|_| AnswerAndClose(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n")).await;
        let failed = pool().send(post(&url, Outgoing::Full(Bytes::from_static(b"{}")))).await;
        assert!(matches!(&failed, Err(SendError::Wire(e)) if !e.may_resend()), "{:?}", failed.err());
        // Nor when a `100 Continue` follows it.
        let (url, _, _) = raw_replica(|_| {
            AnswerAndClose(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n")
        })
        .await;
        let failed = pool().send(post(&url, Outgoing::Full(Bytes::from_static(b"{}")))).await;
        assert!(matches!(&failed, Err(SendError::Wire(e)) if !e.may_resend()), "{:?}", failed.err());
    }

    /// A pooled connection the replica closed while it sat idle is not used again.
    #[tokio::test]
    async fn a_connection_closed_while_idle_is_left_out() {
        let (url, seen, closed) = raw_replica(|_| AnswerAndClose(OK)).await;
        let pool = pool();
        for i in 0..3 {
            let answer =
                exchange(&pool, post(&url, Outgoing::Full(Bytes::from_static(b"{}")))).await.unwrap();
            assert_eq!(answer, (StatusCode::OK, b"ok".to_vec()));
            closed.acquire().await.unwrap().forget();
            // The reactor sees the close once this task lets it run.
            tokio::task::yield_now().await;
            assert_eq!(seen.lock().unwrap().len(), i + 1);
        }
    }

    /// Bytes after the end of a response mean the connection is out of step: not reused.
    #[tokio::test]
    async fn a_connection_with_bytes_past_the_response_is_not_reused() {
        let (answer, idle) =
            post_once(|_| AnswerAtOnce(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200")).await;
        assert_eq!(answer, (StatusCode::OK, b"ok".to_vec()));
        assert_eq!(idle, 0);
    }

    #[tokio::test]
    async fn replies_without_a_body_leave_their_connection_reusable() {
        let (url, seen, _) = raw_replica(|n| match n {
            0 => Answer(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n"),
            _ => Answer(b"HTTP/1.1 204 No Content\r\n\r\n"),
        })
        .await;
        let pool = pool();
        let head = http::Request::head(format!("{url}/v1/x")).body(Outgoing::Full(Bytes::new())).unwrap();
        let response = pool.send(head).await.unwrap();
        assert_eq!(response.headers()[header::CONTENT_LENGTH], "7", "passed on for HEAD");
        assert!(response.body().is_end_stream());
        assert_eq!(
            exchange(&pool, post(&url, Outgoing::Full(Bytes::new()))).await.unwrap().0,
            StatusCode::NO_CONTENT
        );
        assert_eq!(pool.idle_count(), 1);
        assert_eq!(seen.lock().unwrap().len(), 2, "both on one connection");
        let first = String::from_utf8_lossy(&seen.lock().unwrap()[0]).into_owned();
        assert!(!first.contains("content-length"), "no body, no length for HEAD: {first}");
    }

    #[tokio::test]
    async fn malformed_chunked_bodies_are_errors() {
        for answer in [
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\r\nmore".as_slice(),
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n;x\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nokXX3\r\nabc\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        ] {
            let url = one_answer(answer).await;
            let pool = pool();
            let response = pool.send(post(&url, Outgoing::Full(Bytes::new()))).await.unwrap();
            let read = response.into_body().collect().await;
            let error =
                read.err().unwrap_or_else(|| panic!("accepted {:?}", String::from_utf8_lossy(answer)));
            assert!(
                error.downcast_ref::<BodyError>().is_some_and(|e| matches!(e, BodyError::Chunked(_))),
                "{error}"
            );
            assert_eq!(pool.idle_count(), 0);
        }
    }

    /// A replica that answers one request with `answer` and then closes (a script cannot
    /// capture the answer).
    async fn one_answer(answer: &'static [u8]) -> String {
        by_hand(move |listener| async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            read_request(&mut stream).await;
            stream.write_all(answer).await.unwrap();
        })
        .await
    }

    #[tokio::test]
    async fn streamed_bodies_go_out_chunked_or_with_their_length() {
        let (url, seen, _) = raw_replica(|_| Answer(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")).await;
        let pool = pool();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, BoxError>>(4);
        for part in ["abc", "", "defghijklmnopq"] {
            tx.send(Ok(http_body::Frame::data(Bytes::from(part)))).await.unwrap();
        }
        drop(tx);
        let stream = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        exchange(&pool, post(&url, Outgoing::Stream(stream.boxed_unsync()))).await.unwrap();
        exchange(&pool, post(&url, Outgoing::Stream(full(Bytes::from_static(b"sized"))))).await.unwrap();
        let seen = seen.lock().unwrap();
        let chunked = String::from_utf8_lossy(&seen[0]);
        assert!(
            chunked
                .ends_with("transfer-encoding: chunked\r\n\r\n3\r\nabc\r\ne\r\ndefghijklmnopq\r\n0\r\n\r\n"),
            "{chunked}"
        );
        let sized = String::from_utf8_lossy(&seen[1]);
        assert!(sized.ends_with("content-length: 5\r\n\r\nsized"), "{sized}");
    }

    /// A replica by hand: `serve` gets its listener; returns its URL.
    async fn by_hand<F, S>(serve: S) -> String
    where
        S: FnOnce(TcpListener) -> F,
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(serve(listener));
        url
    }

    /// Reads a request head off `stream`, a byte at a time so nothing of the body is read.
    async fn read_head_only(stream: &mut TcpStream) {
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8; 1];
            stream.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
    }

    /// Reads a body of `length` bytes off `stream`.
    async fn read_body_of(stream: &mut TcpStream, length: usize) {
        let mut body = vec![0u8; length];
        stream.read_exact(&mut body).await.unwrap();
    }

    /// POSTs a body of `length` bytes and reads the answer; fails if that takes 20 s.
    async fn send_long(
        pool: &Arc<Pool>,
        url: &str,
        length: usize,
    ) -> Result<(StatusCode, Vec<u8>), BoxError> {
        let body = Outgoing::Full(Bytes::from(vec![b'x'; length]));
        tokio::time::timeout(Duration::from_secs(20), exchange(pool, post(url, body))).await?
    }

    /// A replica may answer before it has read a long body (413, 404) and read no more: its
    /// answer is what the caller gets, not a stalled write or a broken pipe.
    #[tokio::test]
    async fn an_answer_before_the_whole_body_went_out_is_read() {
        let (done, finished) = tokio::sync::oneshot::channel::<()>();
        let url = by_hand(|listener| async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            read_head_only(&mut stream).await;
            stream
                .write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 4\r\n\r\nbig!")
                .await
                .unwrap();
            // Reads nothing more, and keeps the connection open until the test is over.
            let _ = finished.await;
        })
        .await;
        let pool = pool();
        let answer = send_long(&pool, &url, 32 << 20).await.expect("the write did not wait for the replica");
        assert_eq!(answer, (StatusCode::PAYLOAD_TOO_LARGE, b"big!".to_vec()));
        assert_eq!(pool.idle_count(), 0, "a connection with half a request on it is not reused");
        drop(done);
    }

    /// The same when the replica closes right after its answer, its unread body making that
    /// a reset: the answer already received is still what the caller gets, whether the watch
    /// or the failed write notices first.
    #[tokio::test]
    async fn an_answer_then_a_close_before_the_whole_body_went_out_is_read() {
        let url = by_hand(|listener| async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            read_head_only(&mut stream).await;
            stream
                .write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 4\r\n\r\nbig!")
                .await
                .unwrap();
        })
        .await;
        let pool = pool();
        let answer = send_long(&pool, &url, 32 << 20).await.expect("the write did not wait for the replica");
        assert_eq!(answer, (StatusCode::PAYLOAD_TOO_LARGE, b"big!".to_vec()));
        assert_eq!(pool.idle_count(), 0);
    }

    /// A replica closing an idle connection just as a long POST goes out on it cannot have
    /// run it (it never got it whole): it goes out again on a new connection.
    #[tokio::test]
    async fn a_long_post_cut_off_by_a_closing_replica_goes_out_again() {
        // More than the sockets' buffers hold, so the write is still going when the replica
        // closes.
        let long = 32 << 20;
        let url = by_hand(move |listener| async move {
            let (mut first, _) = listener.accept().await.unwrap();
            read_head_only(&mut first).await;
            read_body_of(&mut first, 2).await;
            first.write_all(OK).await.unwrap();
            read_head_only(&mut first).await;
            drop(first);
            let (mut second, _) = listener.accept().await.unwrap();
            read_head_only(&mut second).await;
            read_body_of(&mut second, long).await;
            second.write_all(OK).await.unwrap();
        })
        .await;
        let pool = pool();
        exchange(&pool, post(&url, Outgoing::Full(Bytes::from_static(b"{}")))).await.unwrap();
        assert_eq!(send_long(&pool, &url, long).await.unwrap(), (StatusCode::OK, b"ok".to_vec()));
    }

    /// An interim answer (100 Continue) while a long body goes out is not the answer: the
    /// body goes on, and the final answer comes after.
    #[tokio::test]
    async fn an_interim_answer_does_not_stop_a_long_body() {
        let long = 4 << 20;
        let url = by_hand(move |listener| async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            read_head_only(&mut stream).await;
            stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await.unwrap();
            read_body_of(&mut stream, long).await;
            stream.write_all(OK).await.unwrap();
        })
        .await;
        let pool = pool();
        let answer = send_long(&pool, &url, long).await.expect("the body stopped at the interim answer");
        assert_eq!(answer, (StatusCode::OK, b"ok".to_vec()));
        assert_eq!(pool.idle_count(), 1, "the whole request went out: the connection is reusable");
    }

    /// A `103 Early Hints` read while a long body goes out says the request is under way, as
    /// one read after it does: a close once the body is in is not a request to send again.
    /// It was forgotten, and the request went out twice.
    #[tokio::test]
    async fn an_early_hint_during_a_long_body_then_a_close_is_not_sent_again() {
        // More than the sockets' buffers hold: the hint comes while the body still goes out.
        let long = 32 << 20;
        let url = by_hand(move |listener| async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            read_head_only(&mut stream).await;
            stream.write_all(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n").await.unwrap();
            read_body_of(&mut stream, long).await;
            drop(stream);
            // A second try is answered (this task ends with the test).
            if let Ok((mut again, _)) = listener.accept().await {
                read_head_only(&mut again).await;
                read_body_of(&mut again, long).await;
                again.write_all(OK).await.unwrap();
            }
        })
        .await;
        let sent = send_long(&pool(), &url, long).await;
        let error = sent.expect_err("the request was sent again");
        assert!(
            matches!(error.downcast_ref::<SendError>(), Some(SendError::Wire(e)) if !e.may_resend()),
            "{error}"
        );
    }

    #[tokio::test]
    async fn an_endless_head_while_the_body_goes_out_is_malformed() {
        // The replica reads nothing of a long body and sends a head that never ends: the
        // router stops at MAX_HEAD_BYTES instead of buffering it until a timeout.
        let url = by_hand(|listener| async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            read_head_only(&mut stream).await;
            stream.write_all(b"HTTP/1.1 200 OK\r\nx-endless: ").await.unwrap();
            let more = [b'y'; 1000];
            while stream.write_all(&more).await.is_ok() {}
        })
        .await;
        let sent = send_long(&pool(), &url, 4 << 20).await;
        let error = sent.expect_err("no answer can come of an endless head");
        assert!(
            matches!(error.downcast_ref::<SendError>(), Some(SendError::Wire(WireError::Malformed(_)))),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_failing_request_body_is_the_callers_error() {
        let (url, _, _) = raw_replica(|_| Answer(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")).await;
        let failing = http_body_util::StreamBody::new(futures::stream::iter([
            Ok(http_body::Frame::data(Bytes::from_static(b"part"))),
            Err::<http_body::Frame<Bytes>, BoxError>("the client went away".into()),
        ]));
        let sent = pool().send(post(&url, Outgoing::Stream(failing.boxed_unsync()))).await;
        assert!(matches!(sent, Err(SendError::Wire(WireError::RequestBody(_)))));
    }

    #[tokio::test]
    async fn garbage_instead_of_a_response_is_malformed() {
        let (url, _, _) = raw_replica(|_| Answer(b"SSH-2.0-OpenSSH\r\n\r\n")).await;
        let sent = pool().send(post(&url, Outgoing::Full(Bytes::new()))).await;
        assert!(matches!(sent, Err(SendError::Wire(WireError::Malformed(_)))));
    }
}
