//! The accept loop, with every connection bounded before it is a WebSocket: a permit per TCP
//! connection (`server.max_tcp_connections`; beyond it, a plain `503` and close), the TLS
//! handshake and every HTTP request head within `server.header_timeout_s` (an idle keep-alive
//! connection included), HTTP/1.1 with upgrades through hyper, and a graceful shutdown.
//! (axum's `serve` has no timer, so a socket that never finishes its request was held forever.)

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// What bounds a connection before it reaches the router.
#[derive(Debug, Clone, Copy)]
pub struct AcceptLimits {
    pub max_tcp_connections: usize,
    pub header_timeout: Duration,
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets every connection finish its
/// request in flight (upgraded sockets belong to their sessions by then) and returns.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: AcceptLimits,
    shutdown: impl Future<Output = ()>,
) {
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let permits = Arc::new(Semaphore::new(limits.max_tcp_connections));
    // dropped at shutdown: every connection then shuts down gracefully
    let (stop_tx, stop_rx) = watch::channel(());
    // every connection holds a receiver: when all are gone, all connections are
    let (done_tx, done_rx) = watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // out of file descriptors, or the peer gave up: wait a little, go on
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "refused: {} TCP connections are open \
            (server.max_tcp_connections)", limits.max_tcp_connections);
            refuse(tcp);
            continue;
        };
        let (app, tls, stop, done) = (app.clone(), tls.clone(), stop_rx.clone(), done_rx.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let _done = done;
            let _ = tcp.set_nodelay(true);
            match tls {
                None => serve_connection(tcp, app, limits.header_timeout, stop).await,
                Some(acceptor) => {
                    match tokio::time::timeout(limits.header_timeout, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            serve_connection(stream, app, limits.header_timeout, stop).await
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake failed: {e}"),
                        Err(_) => {
                            tracing::debug!(%peer,
                                "TLS handshake took longer than server.header_timeout_s")
                        }
                    }
                }
            }
        });
    }
    drop(listener);
    drop(stop_tx);
    drop(done_rx);
    done_tx.closed().await;
}

/// One connection: HTTP/1.1 (keep-alive, upgrades), each request head within `header_timeout`.
async fn serve_connection<I>(
    io: I,
    app: Router,
    header_timeout: Duration,
    mut stop: watch::Receiver<()>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service =
        TowerToHyperService::new(app.map_request(|r: hyper::Request<Incoming>| r.map(Body::new)));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
    let mut conn = pin!(builder.serve_connection(TokioIo::new(io), service).with_upgrades());
    let mut stopping = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection: {e}");
                }
                return;
            }
            _ = stop.changed(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Beyond the cap: a short plain answer, written without waiting (the request is not read), then
/// close.
fn refuse(tcp: TcpStream) {
    let reply = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: \
    1\r\nConnection: close\r\nContent-Length: 28\r\n\r\ntoo many connections (TCP)\r\n";
    let _ = tcp.try_write(reply);
}
