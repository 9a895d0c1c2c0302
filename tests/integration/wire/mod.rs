//! The raw WebSocket client of the server tests: a real server on 127.0.0.1:0 with the tiny
//! engine, and a client that sees every message in order.

use std::time::{Duration, Instant};

use antiphon_protocol::AudioFrame;
use antiphon_server::config::Config;
use antiphon_server::Server;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// An engine with one stream place, no queue for replies, and that place kept for admitted calls:
/// a second reply while one plays is refused at once, and so is a new call.
/// (tests/integration/server.rs does not use it.)
#[allow(dead_code)]
pub fn one_place(c: &mut Config) {
    c.engine.max_streams = Some(1);
    c.engine.max_queued = 0;
    c.engine.call_headroom = 1;
}

pub async fn server(edit: impl FnOnce(&mut Config)) -> Server {
    let mut cfg = Config::parse(
        antiphon_server::config::DEFAULT_TOML,
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/configs")),
    )
    .unwrap();
    cfg.server.listen = "127.0.0.1:0".into();
    edit(&mut cfg);
    let models = antiphon_assets::synth::models_in_memory(
        antiphon_assets::synth::Preset::Tiny,
        0,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let s = antiphon_server::start(cfg, models).await.unwrap();
    // wait until warmed up
    let deadline = Instant::now() + Duration::from_secs(60);
    while !s.shared.ready.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "server never got ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s
}

/// A message as the client sees it.
#[derive(Debug, Clone)]
pub enum In {
    Event(Value),
    Audio(AudioFrame),
    Closed(Option<u16>),
}

impl In {
    pub fn seq(&self) -> Option<u64> {
        match self {
            In::Event(v) => v.get("seq").and_then(Value::as_u64),
            In::Audio(f) => Some(f.seq as u64),
            In::Closed(_) => None,
        }
    }
    pub fn ty(&self) -> &str {
        match self {
            In::Event(v) => v["type"].as_str().unwrap_or(""),
            In::Audio(_) => "audio",
            In::Closed(_) => "closed",
        }
    }
}

pub struct Client {
    pub ws: Ws,
}

impl Client {
    pub async fn connect(s: &Server) -> Self {
        Self::connect_to(&format!("ws://{}/v1/realtime", s.addr)).await.unwrap()
    }

    pub async fn connect_to(url: &str) -> Result<Self, tokio_tungstenite::tungstenite::Error> {
        let (ws, _) = tokio_tungstenite::connect_async(url).await?;
        Ok(Self { ws })
    }

    pub async fn send(&mut self, v: Value) {
        self.ws.send(Message::Text(v.to_string().into())).await.unwrap();
    }

    pub async fn send_raw(&mut self, m: Message) {
        let _ = self.ws.send(m).await;
    }

    pub async fn recv(&mut self) -> In {
        match tokio::time::timeout(Duration::from_secs(60), self.ws.next())
            .await
            .expect("a message in time")
        {
            Some(Ok(Message::Text(t))) => In::Event(serde_json::from_str(&t).unwrap()),
            Some(Ok(Message::Binary(b))) => {
                In::Audio(AudioFrame::decode(&b).expect("a whole frame"))
            }
            Some(Ok(Message::Close(c))) => In::Closed(c.map(|c| u16::from(c.code))),
            Some(Ok(_)) => Box::pin(self.recv()).await,
            Some(Err(_)) => In::Closed(None),
            None => In::Closed(None),
        }
    }

    /// Messages until one satisfies `stop` (included).
    pub async fn until(&mut self, stop: impl Fn(&In) -> bool) -> Vec<In> {
        let mut out = vec![];
        loop {
            let m = self.recv().await;
            let done = stop(&m) || matches!(m, In::Closed(_));
            out.push(m);
            if done {
                return out;
            }
        }
    }

    pub async fn event(&mut self, ty: &str) -> Value {
        let ms = self.until(|m| m.ty() == ty).await;
        match ms.last() {
            Some(In::Event(v)) if v["type"] == ty => v.clone(),
            other => panic!("expected {ty}, got {other:?} after {ms:?}"),
        }
    }

    pub async fn create(&mut self, extra: Value) -> Value {
        let mut v = json!({"type": "session.create", "mode": "turn",
            "input_audio": {"codec": "pcm16", "sample_rate": 16000},
                "output_audio": {"codec": "opus"}});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        self.send(v).await;
        self.event("session.created").await
    }
}

pub fn short(codes: u64) -> Value {
    json!({"min_text_tokens": 4, "max_text_tokens": 4, "min_audio_tokens": codes,
        "max_audio_tokens": codes, "seed": 1})
}

pub fn is_done(m: &In) -> bool {
    m.ty() == "response.done"
}

pub async fn reqwest_like_get(s: &Server, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut t = TcpStream::connect(s.addr).await.unwrap();
    t.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = String::new();
    t.read_to_string(&mut buf).await.unwrap();
    buf
}
