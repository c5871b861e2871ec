//! Who pins what: a node's status, as the `baton` command reads it.
//!
//! - a node with a known set of buffers, leases, a quarantine and an orphaned lease:
//!   `baton status --json` reports exactly those numbers, the table shows them, the
//!   metrics say the same, and a holder's death changes them;
//! - an unauthenticated connection gets a refusal and nothing else, whatever it sends;
//!   a wrong token, or a token file others may read, gets no status;
//! - lists are bounded and say how many entries they left out; a linked peer answers
//!   for itself, and a node answers for its tree;
//! - `baton status` against a live renderer: buffers and leases while it runs, and every
//!   importer it lists is a live process of that renderer; its log, redirected, holds no
//!   ANSI colour codes;
//! - `--help` of every example, helper binary and `baton` subcommand exits 0.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/baton_cli.rs"]
mod baton_cli;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;
#[path = "support/renderer.rs"]
mod renderer;

use actors::{DEADLINE, LegacyLike, Lines, Parent, eventually, eventually_async, exited, run};
use baton::actors::{Revoke, token_file_of};
use baton::ipc::HostBackend;
use baton::messages::codec::{FrameDecoder, frame_bytes};
use baton::messages::protocol::{RefuseReason, Refused, StatusRequest, StatusScope};
use baton::messages::{Message, status::NodeStatus};
use msgs::*;
use rustix::process::{Pid, Signal, kill_process};
use serde_json::Value;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `baton ARGS…` on a blocking thread (the node answers on this one), at most `DEADLINE`.
async fn baton(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        baton_cli::run(&baton_cli::baton(), &args, DEADLINE)
    })
    .await
    .unwrap()
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// `baton status --json SOCKET`, parsed.
async fn status_json(socket: &str) -> Value {
    let out = baton(vec!["status".into(), "--json".into(), socket.into()]).await;
    assert!(
        out.status.success(),
        "baton status failed: {}\n{}",
        out.status,
        text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn signal(child: &peer::Peer, sig: Signal) {
    kill_process(Pid::from_raw(child.pid() as i32).expect("a pid"), sig).expect("signal");
}

fn peer_row(json: &Value, pid: u32) -> &Value {
    json["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .unwrap_or_else(|| panic!("no peer row for {pid} in {json:#}"))
}

/// Two importers hold three leases, a stopped one is cut and its memory quarantined, and
/// the node holds a lease of an exporter that died: `baton status --json` reports exactly
/// that, the table shows it, and so do the metrics.
#[test]
fn baton_status_reports_exactly_the_buffers_leases_quarantine_and_orphans_it_holds() {
    const A: u64 = 1024; // u32s: 4 KiB each
    const B: u64 = 2048; // 8 KiB
    const Q: u64 = 4096; // 16 KiB
    run(async {
        let ns = peer::namespace("stat");
        let backend = Arc::new(LegacyLike(HostBackend::with_namespace(&ns).unwrap()));
        let mut parent = Parent::start_with(&ns, backend);
        parent
            .child_env
            .push(("BATON_BACKEND".into(), "host".into()));
        let socket = parent.socket();

        // The admin credential: beside the socket, readable by this uid only.
        let token = token_file_of(Path::new(&socket));
        let mode = std::fs::metadata(&token).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", token.display());

        // Importer A holds two 4 KiB buffers, importer B one 8 KiB buffer.
        let (_a, link_a) = parent.child(&[]).await;
        let (_b, link_b) = parent.child(&[]).await;
        let a1 = parent.pattern_buffer(A as usize, 1).await;
        let a2 = parent.pattern_buffer(A as usize, 2).await;
        let b1 = parent.pattern_buffer(B as usize, 3).await;
        let held = link_a
            .remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![a1.share(), a2.share()],
            })
            .await
            .unwrap();
        assert_eq!(held, 2);
        link_b
            .remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![b1.share()],
            })
            .await
            .unwrap();

        // Holder C keeps a 16 KiB buffer, is stopped, misses a revoke and is cut: the
        // buffer (legacy-like rule) is quarantined while C lives.
        let (mut c, link_c) = parent
            .spawn_linked(
                peer::exe("baton-actor-peer"),
                &["serve", &socket, "stubborn", "linger"],
                true,
            )
            .await;
        let _c_lines = Lines::of(c.take_stdout().expect("piped"));
        let q = parent.pattern_buffer(Q as usize, 4).await;
        let q_id = q.id();
        link_c
            .remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![q.share()],
            })
            .await
            .unwrap();
        drop(q);
        signal(&c, Signal::STOP);
        parent
            .owner
            .send(Revoke {
                buffer: q_id,
                within: Duration::from_millis(200),
            })
            .await
            .unwrap()
            .unwrap();
        eventually(DEADLINE, "the stopped holder to be cut", || {
            parent.events.down_reason(link_c.link_id()).is_some()
        })
        .await;

        // Exporter D lends us a buffer and dies: our lease on it is orphaned.
        let (mut d, link_d) = parent.child(&[]).await;
        let made = link_d
            .remote::<Lend>("lender")
            .send(Lend {
                index: 0,
                len: 256,
                seed: 5,
            })
            .await
            .unwrap();
        let orphan = made
            .buffers
            .into_iter()
            .next()
            .unwrap()
            .open()
            .expect("received");
        let d_pid = d.pid();
        d.kill9();
        eventually(DEADLINE, "the exporter's link to go", || {
            parent.events.down_reason(link_d.link_id()).is_some()
        })
        .await;

        let (a_pid, b_pid, c_pid) = (link_a.process().pid, link_b.process().pid, c.pid());
        let json = status_json(&socket).await;
        eprintln!("status: {json:#}");
        assert_eq!(json["version"], 1);
        assert_eq!(json["pid"], std::process::id());
        assert_eq!(json["buffers"], 4, "a1, a2, b1 and the quarantined one");
        assert_eq!(json["bytes"], 4 * (2 * A + B + Q));
        assert_eq!(json["leases"], 3);
        assert_eq!(json["pinned_bytes"], 4 * (2 * A + B));
        assert_eq!(json["quarantined"], 1);
        assert_eq!(json["quarantined_bytes"], 4 * Q);
        assert_eq!(json["retiring"], 1);
        assert_eq!(json["orphaned"], 1);
        assert_eq!(json["orphaned_bytes"], 4 * 256);
        assert_eq!(
            json["peers"].as_array().unwrap().len(),
            3,
            "A, B, and the cut C"
        );
        let pa = peer_row(&json, a_pid);
        assert_eq!(
            (
                &pa["leases"],
                &pa["pinned_bytes"],
                &pa["linked"],
                &pa["cut"]
            ),
            (
                &Value::from(2),
                &Value::from(8 * A),
                &Value::from(true),
                &Value::from(false)
            )
        );
        assert!(pa["oldest_lease_ms"].as_u64().is_some(), "{pa}");
        let pb = peer_row(&json, b_pid);
        assert_eq!(
            (&pb["leases"], &pb["pinned_bytes"]),
            (&Value::from(1), &Value::from(4 * B))
        );
        let pc = peer_row(&json, c_pid);
        assert_eq!(
            (
                &pc["leases"],
                &pc["linked"],
                &pc["cut"],
                &pc["quarantined_bytes"]
            ),
            (
                &Value::from(0),
                &Value::from(false),
                &Value::from(true),
                &Value::from(4 * Q)
            )
        );
        assert_eq!(pc["oldest_lease_ms"], Value::Null);
        // Largest first: the cut holder's 16 KiB, then A's and B's 8 KiB each.
        assert_eq!(json["peers"][0]["pid"], c_pid);
        let table = json["buffer_table"].as_array().unwrap();
        assert_eq!(table.len(), 4);
        let quarantined: Vec<&Value> = table.iter().filter(|b| b["quarantined"] == true).collect();
        assert_eq!(quarantined.len(), 1);
        assert_eq!(quarantined[0]["bytes"], 4 * Q);
        assert_eq!(quarantined[0]["cut_holders"], serde_json::json!([c_pid]));
        assert_eq!(quarantined[0]["backend"], "Host");
        assert_eq!(quarantined[0]["device"], "host");
        let orphaned = json["orphaned_leases"].as_array().unwrap();
        assert_eq!(orphaned.len(), 1);
        assert_eq!(
            (&orphaned[0]["pid"], &orphaned[0]["leases"]),
            (&Value::from(d_pid), &Value::from(1))
        );
        // The import cache maps the orphaned lease's buffer: one open, still an entry.
        assert_eq!(json["cache"]["entries"], 1);
        assert_eq!(json["cache"]["opens"], 1);
        // Links: A, B, and this command's own.
        let links = json["links"].as_array().unwrap();
        assert_eq!(links.len(), 3, "{links:?}");
        assert_eq!(links.iter().filter(|l| l["requester"] == true).count(), 1);
        assert_eq!(json["omitted"]["peers"], 0);

        // The table says the same.
        let out = baton(vec!["status".into(), socket.clone()]).await;
        assert!(out.status.success(), "{}", text(&out.stderr));
        let table = text(&out.stdout);
        eprintln!("{table}");
        assert!(
            table.contains("exports     4 buffers (32.0 KiB) · 3 leases out · 16.0 KiB pinned · 1 quarantined (16.0 KiB) · 1 retiring"),
            "{table}"
        );
        let c_row = table
            .lines()
            .find(|l| l.starts_with(&c_pid.to_string()))
            .unwrap_or_else(|| panic!("a row for {c_pid} in\n{table}"));
        assert!(c_row.contains("cut: quarantines 16.0 KiB"), "{c_row}");
        assert!(table.contains("QUARANTINED"), "{table}");
        assert!(table.contains("(this command)"), "{table}");

        // The node's own snapshot and its metrics agree.
        let local = parent.node.status(0);
        assert_eq!(
            (
                local.buffers,
                local.leases,
                local.quarantined,
                local.orphaned
            ),
            (4, 3, 1, 1)
        );
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || baton::actors::metrics::record(&local));
        let rendered = handle.render();
        for line in [
            "baton_buffers 4",
            "baton_leases_out 3",
            &format!("baton_pinned_bytes {}", 4 * (2 * A + B)),
            "baton_quarantined_buffers 1",
            "baton_orphaned_leases 1",
            "baton_cache_opens_total 1",
        ] {
            assert!(
                rendered.lines().any(|l| l == line),
                "no {line:?} in\n{rendered}"
            );
        }

        // C's death ends the quarantine; dropping the orphan ends the orphan.
        c.kill9();
        drop(orphan);
        eventually_async(DEADLINE, "the quarantine to end", || async {
            let s = parent.node.status(0);
            s.quarantined == 0 && s.orphaned == 0
        })
        .await;
        let json = status_json(&socket).await;
        assert_eq!(
            (&json["buffers"], &json["quarantined"], &json["orphaned"]),
            (&Value::from(3), &Value::from(0), &Value::from(0))
        );
        assert_eq!(json["peers"].as_array().unwrap().len(), 2);
        drop((a1, a2, b1));
        // D was SIGKILLed before its `Drop` could unlink its named segment: it is left for
        // a sweep (a supervisor's, for its children) — here the test's own, so that the
        // suite leaves /dev/shm as it found it.
        let swept = baton::ipc::host::sweep(&ns).unwrap();
        assert_eq!(swept.removed.len(), 1, "D's segment: {swept:?}");
        assert!(
            swept.removed[0].contains(&format!(".{d_pid}.")),
            "{swept:?}"
        );
    });
}

/// Reads a raw connection until the node drops it; returns every message received.
fn read_to_end(mut s: std::os::unix::net::UnixStream) -> Vec<Message> {
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut decoder = FrameDecoder::new();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = match s.read(&mut buf) {
            Ok(0) => break,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the node did not drop the connection ({e}); got {got:?}"),
            Ok(n) => n,
        };
        decoder.push(&buf[..n]);
        while let Some(frame) = decoder.next_frame().unwrap() {
            got.push(frame.message);
        }
    }
    got
}

/// A connection that has not completed the handshake gets nothing but a refusal: a
/// `StatusRequest` in place of the `Hello` is a protocol violation, refused before any
/// other frame; a wrong token gets no status; the `baton` command refuses a token file
/// others may read.
#[test]
fn an_unauthenticated_status_request_gets_only_a_refusal() {
    run(async {
        let parent = Parent::start("statref");
        let socket = parent.socket();
        let request = Message::StatusRequest(StatusRequest {
            id: 1,
            scope: StatusScope::Tree,
            limit: 256,
        });
        let mut s = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        s.write_all(&frame_bytes(&request, 0).unwrap()).unwrap();
        let got = tokio::task::spawn_blocking(move || read_to_end(s))
            .await
            .unwrap();
        assert_eq!(
            got,
            vec![Message::Refused(Refused {
                reason: RefuseReason::ProtocolViolation
            })],
            "an unauthenticated status request got more than a refusal"
        );
        assert!(parent.node.peers().is_empty());

        // The `baton` command with another session's token: refused in the handshake.
        let dir = tempfile::tempdir().unwrap();
        let wrong = dir.path().join("wrong.token");
        let other = baton::Session::generate().unwrap();
        std::fs::write(&wrong, other.token().to_hex()).unwrap();
        std::fs::set_permissions(&wrong, std::fs::Permissions::from_mode(0o600)).unwrap();
        let out = baton(vec![
            "status".into(),
            "--json".into(),
            "--token-file".into(),
            wrong.display().to_string(),
            socket.clone(),
        ])
        .await;
        assert!(!out.status.success());
        assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
        assert!(
            text(&out.stderr).contains("cannot link to"),
            "{}",
            text(&out.stderr)
        );
        eventually(DEADLINE, "the node to report the refusal", || {
            parent.events.all().into_iter().any(|e| {
                matches!(e, baton::actors::PeerEvent::Refused(why) if format!("{why:?}").contains("BadToken"))
            })
        })
        .await;

        // The right token, but in a file others may read: not trusted.
        let loose = dir.path().join("loose.token");
        std::fs::write(&loose, parent.session.token().to_hex()).unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
        let out = baton(vec![
            "status".into(),
            "--token-file".into(),
            loose.display().to_string(),
            socket.clone(),
        ])
        .await;
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("readable by others"),
            "{}",
            text(&out.stderr)
        );
        assert!(parent.events.ups().is_empty(), "nobody linked");

        // The credential goes with the listener.
        let token = token_file_of(Path::new(&socket));
        assert!(token.exists());
        drop(parent);
        assert!(!token.exists(), "the token file outlived its listener");
    });
}

/// Lists are capped and say what they left out; a linked peer answers for itself over its
/// link, and the node answers for its tree.
#[test]
fn lists_are_bounded_and_a_node_answers_for_its_tree() {
    run(async {
        let parent = Parent::start("statbound");
        let mut buffers = Vec::new();
        for i in 0..70 {
            buffers.push(parent.pattern_buffer(16, i).await);
        }
        let capped = parent.node.status(16);
        assert_eq!(capped.buffers, 70, "totals count everything");
        assert_eq!(capped.buffer_table.len(), 16);
        assert_eq!(capped.omitted.buffer_table, 54);
        assert_eq!(parent.node.status(0).buffer_table.len(), 64, "the default");
        assert_eq!(
            parent.node.status(u32::MAX).buffer_table.len(),
            70,
            "at most 256"
        );

        let (mut child, link) = parent.child(&[]).await;
        let theirs = link.status(0, DEADLINE).await.unwrap();
        assert_eq!(theirs.pid, child.pid());
        assert_eq!(theirs.buffers, 0);
        // The child lists its link to us as the requester.
        assert!(
            theirs
                .links
                .iter()
                .any(|l| l.requester && l.pid == std::process::id())
        );
        let tree: NodeStatus = parent.node.tree_status(0).await;
        let nested: Vec<u32> = tree.tree().iter().map(|s| s.pid).collect();
        assert_eq!(nested, [std::process::id(), child.pid()]);

        // Over the socket, with --tree: the same two nodes.
        let out = baton(vec![
            "status".into(),
            "--tree".into(),
            "--json".into(),
            "--limit".into(),
            "8".into(),
            parent.socket(),
        ])
        .await;
        assert!(out.status.success(), "{}", text(&out.stderr));
        let json: NodeStatus = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json.buffer_table.len(), 8);
        assert_eq!(json.omitted.buffer_table, 62);
        let pids: Vec<u32> = json.tree().iter().map(|s| s.pid).collect();
        assert_eq!(
            pids,
            [std::process::id(), child.pid()],
            "this command's own link is not asked"
        );
        // Its link closed, the child exits.
        link.close();
        exited(&mut child, DEADLINE).await;
    });
}

#[test]
fn baton_status_shows_a_peer_on_another_host_with_its_host_and_address() {
    use baton::actors::{HostSettings, Node, NodeConfig};
    use baton::ipc::tcp::HostId;
    run(async {
        let ns = peer::namespace("stathost");
        let here = |config: NodeConfig| {
            config.hosts(HostSettings {
                host: HostId::named("status-a"),
                ..HostSettings::default()
            })
        };
        let parent = Parent::start_configured(&ns, Arc::new(HostBackend::new().unwrap()), here);
        let elsewhere = Node::with_config(
            NodeConfig::new(parent.session.clone()).hosts(HostSettings {
                host: HostId::named("status-b"),
                ..HostSettings::default()
            }),
            Arc::new(HostBackend::new().unwrap()),
        );
        let mut listening = elsewhere.listen_tcp("127.0.0.1:0").unwrap();
        let to_b = parent
            .node
            .connect_tcp(listening.local_addr())
            .await
            .unwrap();
        listening.accept_timeout(DEADLINE).await.unwrap();
        let b = HostId::named("status-b").to_string();

        let json: NodeStatus = serde_json::from_value(status_json(&parent.socket()).await).unwrap();
        let remote = json
            .links
            .iter()
            .find(|l| l.host.as_deref() == Some(b.as_str()))
            .expect("the host link is listed with its host");
        assert_eq!(remote.addr, Some(listening.local_addr().to_string()));
        assert_eq!(remote.pid, std::process::id());
        assert!(remote.name.is_none(), "a remote pid names no child of ours");

        let out = baton(vec!["status".into(), parent.socket()]).await;
        assert!(out.status.success(), "{}", text(&out.stderr));
        let table = text(&out.stdout);
        assert!(
            table.contains(&format!("@ {} ({b})", listening.local_addr())),
            "the table shows where the remote peer is:\n{table}"
        );
        // The peer on the other host answers for itself over the host link.
        let theirs = to_b.status(0, DEADLINE).await.unwrap();
        assert!(theirs.links.iter().any(|l| l.requester
            && l.host.as_deref() == Some(HostId::named("status-a").to_string().as_str())));
        to_b.close_and_wait().await;
    });
}

/// The parent of `pid` and whether it is a zombie, from `/proc`.
fn parent_and_state(pid: u32) -> Option<(u32, char)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((ppid, state))
}

/// The renderer's tree, killed and reaped when dropped (its children die with their root:
/// `PR_SET_PDEATHSIG`; this test process is their subreaper, so it reaps them too).
struct RendererRun {
    root: Option<std::process::Child>,
    children: Vec<u32>,
}

impl Drop for RendererRun {
    fn drop(&mut self) {
        if let Some(mut root) = self.root.take() {
            let _ = root.kill();
            let _ = root.wait();
        }
        let start = Instant::now();
        for &pid in &self.children {
            let Some(p) = Pid::from_raw(pid as i32) else {
                continue;
            };
            while parent_and_state(pid).is_some() && start.elapsed() < DEADLINE {
                let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG);
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

/// `baton status --tree` on a live renderer's root socket: buffers and leases while it
/// runs, every importer listed a live child of the renderer (its compositor); the
/// renderer's log, redirected to a file, has no ANSI colour codes. `baton sweep` keeps its
/// socket directory while it runs, and removes it once the root was SIGKILLed.
#[test]
fn baton_status_of_a_live_renderer_lists_its_leases_and_live_importers() {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .expect("PR_SET_CHILD_SUBREAPER");
    let exe = renderer::renderer();
    let out = tempfile::tempdir().unwrap();
    let log: PathBuf = out.path().join("renderer.log");
    // The root makes its socket directory in TMPDIR: ours, so that `baton sweep` is tried
    // on it alone, and a failed test leaves nothing in /tmp.
    let tmp = tempfile::tempdir().unwrap();
    let tmp_dir = tmp.path().to_str().unwrap().to_owned();
    let sweep = |dry: bool| {
        let mut args = vec!["sweep", "--sockets-in", &tmp_dir, "--min-age", "0"];
        if dry {
            args.push("--dry-run");
        }
        let out = baton_cli::run(&baton_cli::baton(), &args, DEADLINE);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let root = std::process::Command::new(exe)
        .args([
            "--size",
            "640x360",
            "--frames",
            "1000000",
            "--workers",
            "3",
            "--tile",
            "128",
            "--backend",
            "host",
            "--out",
        ])
        .arg(out.path())
        .env("BATON_BACKEND", "host")
        .env("RUST_LOG", "info")
        .env("TMPDIR", tmp.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let root_pid = root.id();
    let mut run = RendererRun {
        root: Some(root),
        children: Vec::new(),
    };
    let lines = std::sync::mpsc::channel::<String>();
    let stdout = run.root.as_mut().unwrap().stdout.take().unwrap();
    let tx = lines.0;
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let start = Instant::now();
    let socket = loop {
        let line = lines
            .1
            .recv_timeout(DEADLINE.saturating_sub(start.elapsed()))
            .expect("the renderer prints its socket");
        if let Some(path) = line.strip_prefix("socket") {
            break path.trim().to_owned();
        }
    };
    let baton = baton_cli::baton();
    // Poll until a snapshot catches leases out (the compositor holds the tiles of a frame
    // while it composes them).
    let start = Instant::now();
    let status = loop {
        let out = baton_cli::run(&baton, &["status", "--tree", "--json", &socket], DEADLINE);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let status: NodeStatus = serde_json::from_slice(&out.stdout).unwrap();
        let tree = status.tree();
        let (buffers, leases): (u64, u64) = (
            tree.iter().map(|s| s.buffers).sum(),
            tree.iter().map(|s| s.leases).sum(),
        );
        if tree.len() == 5 && buffers > 0 && leases > 0 {
            break status;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no snapshot with buffers and leases out within {DEADLINE:?}: {status:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    run.children = status.children.iter().filter_map(|c| c.pid).collect();
    assert_eq!(status.pid, root_pid);
    let names: Vec<&str> = status.children.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["compositor", "worker-0", "worker-1", "worker-2"]);
    assert!(status.children.iter().all(|c| c.state == "running"));
    let compositor = status.children[0].pid.unwrap();
    let importers: Vec<u32> = status
        .tree()
        .iter()
        .flat_map(|s| s.peers.iter().map(|p| p.pid))
        .collect();
    assert!(!importers.is_empty());
    for pid in &importers {
        let (ppid, state) = parent_and_state(*pid)
            .unwrap_or_else(|| panic!("importer {pid} is not a live process"));
        assert_eq!(ppid, root_pid, "importer {pid} is a child of the renderer");
        assert!(
            state != 'Z' && state != 'X',
            "importer {pid} is alive ({state})"
        );
        assert_eq!(
            *pid, compositor,
            "the renderer's importer is its compositor"
        );
    }
    // The table, for the record.
    let table = baton_cli::run(&baton, &["status", "--tree", &socket], DEADLINE);
    eprintln!("{}", text(&table.stdout));
    let top = baton_cli::run(&baton, &["top", "--once", &socket], DEADLINE);
    assert!(top.status.success(), "{}", text(&top.stderr));
    let screen = text(&top.stdout);
    eprintln!("{screen}");
    assert!(
        screen.contains(&format!("compositor ({compositor})")),
        "{screen}"
    );
    assert!(screen.contains("5 nodes"), "{screen}");

    // While the root listens, its socket directory is not a dead node's.
    let dir = Path::new(&socket).parent().unwrap().to_owned();
    assert!(dir.starts_with(tmp.path()), "{}", dir.display());
    let kept = sweep(false);
    assert!(kept.contains(": removed 0 of dead nodes, kept 1"), "{kept}");
    assert!(Path::new(&socket).exists());

    drop(run); // SIGKILLs the root; its children die with it
    // The killed root could not remove its socket directory: the sweep does, once nobody
    // listens there (a dry run first names it and removes nothing).
    let planned = sweep(true);
    assert!(
        planned.contains(&format!("would remove {}", dir.display())),
        "{planned}"
    );
    assert!(dir.exists());
    let swept = sweep(false);
    assert!(
        swept.contains(&format!("removed {}", dir.display())),
        "{swept}"
    );
    assert!(!dir.exists(), "{swept}");
    let log = std::fs::read(&log).unwrap();
    assert!(!log.is_empty(), "RUST_LOG=info logged something");
    assert!(
        !log.windows(2).any(|w| w == b"\x1b["),
        "ANSI escape codes in a redirected log"
    );
}

/// `--help` of every example, every helper binary, and `baton` and its subcommands.
#[test]
fn every_example_and_binary_answers_help() {
    let mut targets: Vec<(PathBuf, Vec<&str>)> = [
        "renderer",
        "host_roundtrip",
        "typed_messages",
        "embed_in_service",
        "load",
        "py_partner",
    ]
    .iter()
    .map(|e| (renderer::example(e), vec!["--help"]))
    .collect();
    for bin in [
        peer::exe("baton-actor-peer"),
        peer::exe("baton-test-peer"),
        peer::exe("baton-flood-peer"),
        peer::exe("baton-conformance-peer"),
        peer::exe("baton-ordering-peer"),
    ] {
        targets.push((PathBuf::from(bin), vec!["--help"]));
    }
    let baton = baton_cli::baton();
    for sub in [
        vec!["--help"],
        vec!["status", "--help"],
        vec!["top", "--help"],
        vec!["sweep", "--help"],
    ] {
        targets.push((baton.clone(), sub));
    }
    for (exe, args) in &targets {
        let out = baton_cli::run(exe, args, DEADLINE);
        let help = text(&out.stdout);
        assert!(
            out.status.success() && help.contains("Usage:"),
            "{} {args:?}: {}\n{help}{}",
            exe.display(),
            out.status,
            text(&out.stderr)
        );
    }
    // The renderer keeps its flags.
    let help = text(&baton_cli::run(&targets[0].0, &["--help"], DEADLINE).stdout);
    for flag in [
        "--size",
        "--frames",
        "--workers",
        "--tile",
        "--backend",
        "--chaos",
        "--out",
        "--staged",
        "--verify",
        "--no-sweep",
    ] {
        assert!(help.contains(flag), "the renderer lost {flag}:\n{help}");
    }
}

/// A link may have at most four status answers in preparation: a tree answer waits for a
/// stopped peer (and names it, without its status, after the deadline), and a fifth
/// request while four wait is a protocol fault that cuts the asker, not the node.
#[test]
fn status_requests_are_bounded_per_link_and_a_silent_peer_is_named_not_waited_for() {
    use baton::ipc::{Link, LinkConfig};
    run(async {
        let parent = Parent::start("statflood");
        let (child, _link) = parent.child(&[]).await;
        let child_pid = child.pid();
        signal(&child, Signal::STOP);
        let (socket, session) = (parent.socket(), parent.session.clone());
        let (answers, me) = tokio::task::spawn_blocking(move || {
            let request = |id| {
                Message::StatusRequest(StatusRequest {
                    id,
                    scope: StatusScope::Tree,
                    limit: 8,
                })
            };
            let mut link = Link::connect(&socket, &LinkConfig::new(session)).unwrap();
            let me = link.peer().process;
            for id in 1..=4 {
                link.send(&request(id), &[]).unwrap();
            }
            let mut answers = Vec::new();
            while answers.len() < 4 {
                match link.recv_timeout(DEADLINE).unwrap().message {
                    Message::Status(s) => answers.push(s),
                    Message::Ping(n) => link.send(&Message::Pong(n), &[]).unwrap(),
                    _ => {}
                }
            }
            // Five at once: the fifth arrives while four wait for the stopped peer.
            for id in 5..=9 {
                let _ = link.send(&request(id), &[]);
            }
            loop {
                match link.recv_timeout(DEADLINE) {
                    Ok(_) => {}
                    Err(baton::ipc::Error::Closed) => break,
                    Err(baton::ipc::Error::Io { source, .. })
                        if source.kind() == std::io::ErrorKind::ConnectionReset =>
                    {
                        break;
                    }
                    Err(e) => panic!("the node did not cut the flooding link: {e}"),
                }
            }
            (answers, me)
        })
        .await
        .unwrap();
        for answer in &answers {
            let status = NodeStatus::from_json(&answer.json).unwrap();
            let entry = status
                .links
                .iter()
                .find(|l| l.pid == child_pid)
                .expect("the stopped child is listed");
            assert!(entry.status.is_none());
            let why = entry.status_error.as_deref().unwrap_or_default();
            assert!(why.contains("timed out"), "{why}");
        }
        eventually(
            DEADLINE,
            "the flooding link to be cut as a protocol fault",
            || {
                parent.events.all().into_iter().any(|e| match e {
                    baton::actors::PeerEvent::Down {
                        peer,
                        reason: Some(r),
                        ..
                    } => {
                        peer.process == me
                            && matches!(
                                *r,
                                baton::actors::ActorError::TooManyStatusRequests { max: 4 }
                            )
                    }
                    _ => false,
                })
            },
        )
        .await;
        // The node carries on: it still answers.
        assert_eq!(parent.node.status(0).pid, std::process::id());
    });
}
