//! Two "hosts" on one machine: two network namespaces joined by a veth pair, each held
//! by a sleeping process of its own (no named namespace in `/run/netns`: they go when
//! their last process exits, and the veth pair with them).
//!
//! Made where this process may (as root, with `ip`, `unshare` and `nsenter`); elsewhere
//! [`TwoHosts::make`] says why not, and the caller uses loopback TCP instead. Programs run
//! inside a namespace through `nsenter -t <holder> -n`, which keeps the descriptors and
//! environment it is given (the session token's pipe among them).
//!
//! Also compiled into `tests/cross_host_netns.rs`.

#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The two namespaces' addresses on the veth pair.
pub const ADDRS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 77, 0, 1), Ipv4Addr::new(10, 77, 0, 2)];

/// Two network namespaces joined by a veth pair; dropping it kills and reaps their
/// holders (kill the programs run inside first).
pub struct TwoHosts {
    holders: Vec<Child>,
    nsenter: PathBuf,
}

/// `name` in `PATH` or the usual system directories.
fn tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Runs `cmd` to completion within 10 s; its failure as text.
fn run(cmd: &mut Command) -> Result<(), String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: {e}"))?;
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            if status.success() {
                return Ok(());
            }
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            return Err(format!("{what}: {status}: {}", err.trim()));
        }
        if start.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{what}: did not finish within 10 s"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn net_ns(pid: &str) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()
}

impl TwoHosts {
    /// Makes the two namespaces and the veth pair between them (`ADDRS[0]` in the first,
    /// `ADDRS[1]` in the second, /24), or says why it cannot.
    pub fn make() -> Result<TwoHosts, String> {
        if !rustix::process::geteuid().is_root() {
            return Err(
                "not root (making network namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN)".into(),
            );
        }
        let (Some(ip), Some(unshare), Some(nsenter)) =
            (tool("ip"), tool("unshare"), tool("nsenter"))
        else {
            return Err("`ip`, `unshare` or `nsenter` is missing".into());
        };
        let ours = net_ns("self");
        let mut hosts = TwoHosts {
            holders: Vec::new(),
            nsenter,
        };
        for _ in 0..2 {
            let holder = Command::new(&unshare)
                .args(["--net", "--", "sleep", "600"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("spawning `unshare --net`: {e}"))?;
            hosts.holders.push(holder);
        }
        // Each holder is in its namespace once `unshare` has exec'd `sleep`.
        let start = Instant::now();
        for i in 0..2 {
            let pid = hosts.pid(i).to_string();
            while net_ns(&pid) == ours || net_ns(&pid).is_none() {
                if let Ok(Some(status)) = hosts.holders[i].try_wait() {
                    return Err(format!("`unshare --net` exited: {status} (no permission?)"));
                }
                if start.elapsed() > Duration::from_secs(10) {
                    return Err("`unshare --net` did not enter a new namespace within 10 s".into());
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let (a, b) = (hosts.pid(0).to_string(), hosts.pid(1).to_string());
        run(Command::new(&ip).args([
            "link", "add", "baton-a", "netns", &a, "type", "veth", "peer", "name", "baton-b",
            "netns", &b,
        ]))?;
        for (i, dev) in ["baton-a", "baton-b"].into_iter().enumerate() {
            let addr = format!("{}/24", ADDRS[i]);
            for args in [
                vec!["ip", "addr", "add", &addr, "dev", dev],
                vec!["ip", "link", "set", dev, "up"],
                vec!["ip", "link", "set", "lo", "up"],
            ] {
                let mut cmd = hosts.command(i, &ip);
                cmd.args(&args[1..]);
                run(&mut cmd)?;
            }
        }
        Ok(hosts)
    }

    /// The pid of namespace `i`'s holder.
    pub fn pid(&self, i: usize) -> u32 {
        self.holders[i].id()
    }

    /// `nsenter` and its arguments before a program to run inside namespace `i`.
    pub fn enter(&self, i: usize) -> (&Path, [String; 4]) {
        let args = [
            "-t".into(),
            self.pid(i).to_string(),
            "-n".into(),
            "--".into(),
        ];
        (&self.nsenter, args)
    }

    /// A command that runs `program` inside namespace `i` (0 or 1).
    pub fn command(&self, i: usize, program: &Path) -> Command {
        let (nsenter, args) = self.enter(i);
        let mut cmd = Command::new(nsenter);
        cmd.args(args).arg(program);
        cmd
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for holder in &mut self.holders {
            let _ = holder.kill();
            let _ = holder.wait();
        }
    }
}
