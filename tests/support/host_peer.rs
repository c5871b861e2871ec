//! The cross-host tests' helper process, `baton-host-peer` (test-peers), spawned on a
//! host of its own (`BATON_HOST_ID`) with the session's token, and the lines it prints.

#![allow(dead_code)]

use super::peer;
use baton::Session;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The lines a helper prints, read on a thread of their own.
pub struct Lines {
    rx: mpsc::Receiver<String>,
    what: String,
}

impl Lines {
    /// The next line starting with `prefix` (its rest); earlier lines are skipped. Panics
    /// past `deadline`, or if the helper's stdout ends first.
    pub async fn expect(&self, prefix: &str, deadline: Duration) -> String {
        let start = Instant::now();
        loop {
            match self.rx.try_recv() {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return rest.to_owned();
                    }
                }
                Err(mpsc::TryRecvError::Empty) => {
                    assert!(
                        start.elapsed() < deadline,
                        "{}: no line `{prefix}…` within {deadline:?}",
                        self.what
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(mpsc::TryRecvError::Disconnected) => {
                    panic!("{}: its output ended before a line `{prefix}…`", self.what)
                }
            }
        }
    }
}

/// `baton-host-peer ARGS` on host `host`, with the session's token; its stdout's lines.
pub fn host_peer(session: &Session, ns: &str, host: &str, args: &[&str]) -> (peer::Peer, Lines) {
    host_peer_via(None, session, ns, host, args)
}

/// As [`host_peer`], run through `enter` (a program and its arguments before the
/// helper's path: `nsenter -t PID -n --`) when given.
pub fn host_peer_via(
    enter: Option<(&Path, &[String])>,
    session: &Session,
    ns: &str,
    host: &str,
    args: &[&str],
) -> (peer::Peer, Lines) {
    host_peer_env(enter, session, ns, host, args, &[])
}

/// As [`host_peer_via`], with `env` added to the helper's environment.
pub fn host_peer_env(
    enter: Option<(&Path, &[String])>,
    session: &Session,
    ns: &str,
    host: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (peer::Peer, Lines) {
    let exe = peer::exe("baton-host-peer");
    let (program, argv): (&str, Vec<&str>) = match enter {
        None => (exe, args.to_vec()),
        Some((via, before)) => (
            via.to_str().expect("a UTF-8 path"),
            before
                .iter()
                .map(String::as_str)
                .chain(std::iter::once(exe))
                .chain(args.iter().copied())
                .collect(),
        ),
    };
    let mut child = peer::Peer::spawn_with(
        program,
        session,
        ns,
        &argv,
        &[(baton::ipc::tcp::HOST_ID_ENV, host)]
            .into_iter()
            .chain(env.iter().copied())
            .collect::<Vec<_>>(),
        true,
    );
    let lines = read_lines(&mut child, format!("baton-host-peer {args:?}"));
    (child, lines)
}

/// The lines of `child`'s stdout (spawned with a pipe), read on a thread of their own;
/// `what` names the child in failures.
pub fn read_lines(child: &mut peer::Peer, what: String) -> Lines {
    let out = child.take_stdout().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Lines { rx, what }
}
