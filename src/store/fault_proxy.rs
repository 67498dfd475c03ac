//! A loopback HTTP proxy for the store's fault tests: it passes requests to
//! the S3 server, except those its rule picks, which it answers itself (503
//! SlowDown, 412) or drops (the connection closed, no answer). One request per
//! connection: it asks the server to close after each answer.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// What the proxy does with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    Pass,
    /// `503 Slow Down` with S3's SlowDown body.
    SlowDown,
    /// `412 Precondition Failed`.
    PreconditionFailed,
    /// Close the connection without an answer.
    Drop,
}

pub(crate) struct FaultProxy {
    pub(crate) port: u16,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

type Rule = dyn Fn(&str) -> Action + Send + Sync;

impl FaultProxy {
    /// A proxy to the server on `upstream`; `rule` sees each request line
    /// (`PUT /bucket/key?partNumber=2&uploadId=... HTTP/1.1`).
    pub(crate) fn start(
        upstream: u16,
        rule: impl Fn(&str) -> Action + Send + Sync + 'static,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let rule: Arc<Rule> = Arc::new(rule);
        let accept = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let rule = rule.clone();
                    std::thread::spawn(move || {
                        let _ = serve(conn, upstream, &*rule);
                    });
                }
            })
        };
        FaultProxy {
            port,
            stop,
            accept: Some(accept),
        }
    }

    pub(crate) fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so that it sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn serve(client: TcpStream, upstream: u16, rule: &Rule) -> std::io::Result<()> {
    let mut reader = BufReader::new(client.try_clone()?);
    let mut head = Vec::new();
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
        if lower.starts_with("connection:") {
            continue;
        }
        if line == "\r\n" {
            break;
        }
        head.push(line);
    }
    let action = rule(head[0].trim_end());
    let mut client = client;
    let answer = |status: &str, code: &str| {
        let body = format!("<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>injected by the test proxy</Message></Error>");
        format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    match action {
        Action::Pass => {
            let mut up = TcpStream::connect(("127.0.0.1", upstream))?;
            let mut out = head.concat();
            out.push_str("Connection: close\r\n\r\n");
            up.write_all(out.as_bytes())?;
            // The body: what the reader holds already, then the rest.
            std::io::copy(&mut reader.by_ref().take(length as u64), &mut up)?;
            std::io::copy(&mut up, &mut client)?;
        }
        Action::SlowDown | Action::PreconditionFailed => {
            std::io::copy(
                &mut reader.by_ref().take(length as u64),
                &mut std::io::sink(),
            )?;
            let text = if action == Action::SlowDown {
                answer("503 Slow Down", "SlowDown")
            } else {
                answer("412 Precondition Failed", "PreconditionFailed")
            };
            client.write_all(text.as_bytes())?;
        }
        Action::Drop => {}
    }
    client.shutdown(Shutdown::Both)
}
