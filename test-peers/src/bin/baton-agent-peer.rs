//! The helper process of Baton's remote supervision tests (`tests/remote_supervision.rs`):
//! a child agent on another "host" (its own `BATON_HOST_ID`), the children it starts, or a
//! supervisor of children on another host.
//!
//! - `baton-agent-peer agent ADDR [--limit N]`: a node that listens for host links at ADDR
//!   and serves a `ChildAgent` whose table holds two specs: `sleeper` (this binary,
//!   `child`) and `exit3` (`child --exit 3`). Prints `listening <addr>`, then serves until
//!   killed (at most 10 minutes). `--limit N`: at most N children per caller (its key);
//!   `--total N`: at most N in all.
//! - `baton-agent-peer child [--exit N]`: a child the agent starts. Takes the token, links
//!   back to `BATON_CONNECT_TCP` if set (printing `child-linked <pid>`), then stays until
//!   killed (at most 10 minutes), or with `--exit N` exits with code N once linked.
//! - `baton-agent-peer supervise ADDR [--count N] [--spec S]`: a node (host `c`) that
//!   listens on loopback for its children's links and runs a `ProcessSupervisor` of N
//!   children `worker-<i>` of the agent's spec S (default `sleeper`) at ADDR; prints
//!   `started <name> <pid>` for each start, `exited <name> <status>`, `lost <name>`,
//!   and serves until killed (at most 10 minutes).
//!
//! Session from the token pipe (`BATON_TOKEN_FD`), taken at the top of `main`; host memory;
//! `--heartbeat-ms D`: a heartbeat deadline of D ms (pings every D/4).

use actix::prelude::*;
use baton::actors::supervisor::agent::{AgentLimits, CONNECT_TCP_ENV, ChildAgent};
use baton::actors::{
    ChildSpec, Heartbeat, HostSettings, Node, NodeConfig, ProcessSupervisor, RemoteChildSpec,
    RestartPolicy, Strategy, SupervisorEvent,
};
use baton::ipc::HostBackend;
use baton::ipc::tcp::HostId;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

/// How long this helper lives at most.
const LIFETIME: Duration = Duration::from_secs(600);

#[derive(clap::Parser)]
#[command(about = "The helper process of Baton's remote supervision tests")]
struct Cli {
    /// agent | child | supervise
    role: String,
    /// agent: where to listen; supervise: the agent's address.
    addr: Option<String>,
    /// The heartbeat deadline in milliseconds (pings every quarter of it).
    #[arg(long)]
    heartbeat_ms: Option<u64>,
    /// agent: children per caller (its key over a host link).
    #[arg(long)]
    limit: Option<usize>,
    /// agent: children in all.
    #[arg(long)]
    total: Option<usize>,
    /// child: exit with this code once linked.
    #[arg(long)]
    exit: Option<i32>,
    /// supervise: how many children.
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// supervise: the agent's spec.
    #[arg(long, default_value = "sleeper")]
    spec: String,
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn node(cli: &Cli, session: baton::Session, host: Option<&str>) -> Result<Node, String> {
    let mut config = NodeConfig::new(session);
    if let Some(host) = host {
        config = config.hosts(HostSettings {
            host: HostId::named(host),
            ..HostSettings::default()
        });
    }
    if let Some(ms) = cli.heartbeat_ms {
        config = config.heartbeat(Heartbeat {
            interval: Duration::from_millis(ms / 4),
            deadline: Duration::from_millis(ms),
        });
    }
    Ok(Node::with_config(
        config,
        Arc::new(HostBackend::new().map_err(|e| e.to_string())?),
    ))
}

async fn agent(cli: Cli, session: baton::Session) -> Result<(), String> {
    let addr = cli.addr.clone().ok_or("agent: no address")?;
    let node = node(&cli, session, None)?;
    let exe = |name: &str| ChildSpec::this_exe(name).map_err(|e| e.to_string());
    let mut limits = AgentLimits::default();
    if let Some(limit) = cli.limit {
        limits.children_per_caller = limit;
    }
    if let Some(total) = cli.total {
        limits.children_total = total;
    }
    let _agent = ChildAgent::new(node.clone())
        .allow("sleeper", exe("sleeper")?.arg("child"))
        .allow("exit3", exe("exit3")?.arg("child").arg("--exit").arg("3"))
        .limits(limits)
        .serve();
    let listening = node.listen_tcp(addr.as_str()).map_err(|e| e.to_string())?;
    say(&format!("listening {}", listening.local_addr()));
    tokio::time::sleep(LIFETIME).await;
    Ok(())
}

async fn child(cli: Cli, session: baton::Session) -> Result<(), String> {
    let node = node(&cli, session, None)?;
    let _link = match std::env::var(CONNECT_TCP_ENV) {
        Ok(addr) => {
            let peer = tokio::time::timeout(Duration::from_secs(30), node.connect_tcp(addr))
                .await
                .map_err(|_| "connect_tcp timed out".to_owned())?
                .map_err(|e| e.to_string())?;
            say(&format!("child-linked {}", std::process::id()));
            Some(peer)
        }
        Err(_) => None,
    };
    if let Some(code) = cli.exit {
        std::process::exit(code);
    }
    tokio::time::sleep(LIFETIME).await;
    Ok(())
}

struct Printer;

impl Actor for Printer {
    type Context = Context<Self>;
}

impl Handler<SupervisorEvent> for Printer {
    type Result = ();
    fn handle(&mut self, event: SupervisorEvent, _: &mut Context<Self>) {
        match event {
            SupervisorEvent::Started { name, pid, .. } => say(&format!("started {name} {pid}")),
            SupervisorEvent::Exited { name, status, .. } => say(&format!("exited {name} {status}")),
            SupervisorEvent::Lost { name, .. } => say(&format!("lost {name}")),
            _ => {}
        }
    }
}

async fn supervise(cli: Cli, session: baton::Session) -> Result<(), String> {
    let agent: std::net::SocketAddr = cli
        .addr
        .as_deref()
        .ok_or("supervise: no agent address")?
        .parse()
        .map_err(|e| format!("the agent's address: {e}"))?;
    let node = node(&cli, session, Some("c"))?;
    let listening = node.listen_tcp("127.0.0.1:0").map_err(|e| e.to_string())?;
    let children = (0..cli.count)
        .map(|i| RemoteChildSpec::new(format!("worker-{i}"), agent, cli.spec.clone()))
        .collect();
    let _supervisor = ProcessSupervisor::new(
        node,
        Vec::new(),
        Strategy::OneForOne,
        RestartPolicy::default(),
    )
    .remote_children(children)
    .connect_back_tcp(listening.local_addr())
    .subscriber(Printer.start().recipient())
    .start();
    tokio::time::sleep(LIFETIME).await;
    Ok(())
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    // The child's entry point: the token first (its pipe closed), then logging.
    let session = baton_test_peers::start("baton-agent-peer");
    let result = System::new().block_on(async move {
        match cli.role.as_str() {
            "agent" => agent(cli, session).await,
            "child" => child(cli, session).await,
            "supervise" => supervise(cli, session).await,
            other => Err(format!("unknown role {other}")),
        }
    });
    if let Err(e) = result {
        eprintln!("baton-agent-peer: {e}");
        std::process::exit(2);
    }
}
