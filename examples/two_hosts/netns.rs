//! Two "hosts" on one machine: two network namespaces joined by a veth pair, each held
//! by a sleeping process of its own (no named namespace in `/run/netns`: they go when
//! their last process exits, and the veth pair with them).
//!
//! Made where this process may, with `ip`, `unshare` and `nsenter`: as root, or else in a
//! user namespace of its own (`unshare --user --map-root-user --net` for the first, an
//! `unshare --net` inside that user namespace for the second, so that one user namespace
//! owns both and may join them; `BATON_NETNS=userns` picks this way as root too).
//! Elsewhere [`TwoHosts::make`] says why not, and the caller uses loopback TCP instead.
//! Programs run inside a namespace through `nsenter -t <holder> -n` (and `-U` in a user
//! namespace), which keeps the descriptors and environment it is given (the session
//! token's pipe among them).
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
    /// Made in a user namespace of our own (not as root): joined with `-U` too.
    userns: bool,
    /// How long the veth pair took to be running after it was set up.
    running_after: Duration,
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
    output(cmd).map(drop)
}

/// Runs `cmd` to completion within 10 s: its standard output, or its failure as text.
fn output(cmd: &mut Command) -> Result<String, String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: {e}"))?;
    // `ip` prints a line or two: the pipe never fills before it exits.
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            let read = |pipe: Option<&mut dyn std::io::Read>| {
                let mut text = String::new();
                if let Some(p) = pipe {
                    let _ = p.read_to_string(&mut text);
                }
                text
            };
            let out = read(child.stdout.as_mut().map(|p| p as _));
            if status.success() {
                return Ok(out);
            }
            let err = read(child.stderr.as_mut().map(|p| p as _));
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
        let userns = !rustix::process::geteuid().is_root()
            || std::env::var("BATON_NETNS").is_ok_and(|v| v == "userns");
        let (Some(ip), Some(unshare), Some(nsenter)) =
            (tool("ip"), tool("unshare"), tool("nsenter"))
        else {
            return Err("`ip`, `unshare` or `nsenter` is missing".into());
        };
        let ours = net_ns("self");
        let mut hosts = TwoHosts {
            holders: Vec::new(),
            nsenter,
            userns,
            running_after: Duration::ZERO,
        };
        for i in 0..2 {
            let mut holder = match (userns, i) {
                (false, _) => Command::new(&unshare),
                (true, 0) => {
                    let mut cmd = Command::new(&unshare);
                    cmd.args(["--user", "--map-root-user"]);
                    cmd
                }
                // The second, in the first one's user namespace.
                (true, _) => {
                    let mut cmd = Command::new(&hosts.nsenter);
                    cmd.args([
                        "-t",
                        &hosts.pid(0).to_string(),
                        "-U",
                        "--preserve-credentials",
                    ])
                    .arg("--")
                    .arg(&unshare);
                    cmd
                }
            };
            let holder = holder
                .args(["--net", "--", "sleep", "600"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("spawning `unshare --net`: {e}"))?;
            hosts.holders.push(holder);
            // In its namespace once `unshare` has exec'd `sleep`.
            let pid = hosts.pid(i).to_string();
            let start = Instant::now();
            while net_ns(&pid) == ours || net_ns(&pid).is_none() {
                if let Ok(Some(status)) = hosts.holders[i].try_wait() {
                    let how = if userns {
                        "in a user namespace"
                    } else {
                        "as root"
                    };
                    return Err(format!(
                        "`unshare --net` {how} exited: {status} (not permitted here?)"
                    ));
                }
                if start.elapsed() > Duration::from_secs(10) {
                    return Err("`unshare --net` did not enter a new namespace within 10 s".into());
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let (a, b) = (hosts.pid(0).to_string(), hosts.pid(1).to_string());
        // Made from inside the first namespace (and its user namespace, if any).
        let mut add = hosts.command(0, &ip);
        add.args([
            "link", "add", "baton-a", "netns", &a, "type", "veth", "peer", "name", "baton-b",
            "netns", &b,
        ]);
        run(&mut add)?;
        for (i, dev) in ["baton-a", "baton-b"].into_iter().enumerate() {
            let addr = format!("{}/24", ADDRS[i]);
            for args in [
                vec!["ip", "addr", "add", &addr, "dev", dev],
                // IPv4 only: no IPv6 link-local address, so nothing changes the link's
                // addresses in its first seconds. (Tried against NCCL's bootstrap finding
                // no interface in these namespaces, runs H-L: it did not cure that;
                // docs/CROSS_HOST.md.)
                vec!["ip", "link", "set", dev, "addrgenmode", "none"],
                vec!["ip", "link", "set", dev, "up"],
                vec!["ip", "link", "set", "lo", "up"],
            ] {
                let mut cmd = hosts.command(i, &ip);
                cmd.args(&args[1..]);
                run(&mut cmd)?;
            }
        }
        // NCCL (and anything else that lists interfaces) skips an interface that is not
        // RUNNING, and the kernel marks a veth RUNNING (operationally up) a moment after
        // `ip link set up`, from its link-watch work (up to a second later): a program
        // started at once found no interface (runs H-L, docs/CROSS_HOST.md).
        let start = Instant::now();
        for (i, dev) in ["baton-a", "baton-b"].into_iter().enumerate() {
            hosts.wait_running(i, &ip, dev, start + Duration::from_secs(10))?;
        }
        hosts.running_after = start.elapsed();
        Ok(hosts)
    }

    /// Waits until `dev` in namespace `i` is operationally up (RUNNING), until `by`.
    fn wait_running(&self, i: usize, ip: &Path, dev: &str, by: Instant) -> Result<(), String> {
        loop {
            let mut cmd = self.command(i, ip);
            cmd.args(["-o", "link", "show", "dev", dev]);
            let shown = output(&mut cmd)?;
            // `state UP` is the operational state, which RUNNING reports.
            if shown.contains(" state UP ") {
                return Ok(());
            }
            if Instant::now() >= by {
                return Err(format!(
                    "{dev} is not running 10 s after it was set up: {}",
                    shown.trim()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// How long the veth pair took to be running after it was set up.
    pub fn running_after(&self) -> Duration {
        self.running_after
    }

    /// The pid of namespace `i`'s holder.
    pub fn pid(&self, i: usize) -> u32 {
        self.holders[i].id()
    }

    /// `nsenter` and its arguments before a program to run inside namespace `i`.
    pub fn enter(&self, i: usize) -> (&Path, Vec<String>) {
        let mut args = vec!["-t".into(), self.pid(i).to_string(), "-n".into()];
        if self.userns {
            args.extend(["-U".into(), "--preserve-credentials".into()]);
        }
        args.push("--".into());
        (&self.nsenter, args)
    }

    /// Limits what namespace `i` sends over the veth pair to `rate` (`tc` notation,
    /// `200mbit`), with a token bucket filter: so that a large transfer stays in flight.
    pub fn throttle(&self, i: usize, rate: &str) -> Result<(), String> {
        let tc = tool("tc").ok_or("`tc` is missing")?;
        let dev = ["baton-a", "baton-b"][i];
        let mut cmd = self.command(i, &tc);
        cmd.args(["qdisc", "add", "dev", dev, "root", "tbf", "rate", rate])
            .args(["burst", "64kb", "latency", "100ms"]);
        run(&mut cmd)
    }

    /// How they were made: `"as root"` or `"in a user namespace"`.
    pub fn how(&self) -> &'static str {
        if self.userns {
            "in a user namespace"
        } else {
            "as root"
        }
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
