//! `baton`: see who pins what in a running Baton node.
//!
//! ```text
//! baton status SOCKET [--tree] [--json]   what the node holds, who holds what of it
//! baton top SOCKET                        the same, live, for the node and its tree
//! baton sweep [--namespace NS]            remove named host segments of dead owners,
//!                                         and socket directories of dead nodes
//! ```
//!
//! Run by the node's user, it needs only the socket's path: a node writes its admin
//! credential beside its socket (`<socket>.token`, mode 0600, in a directory only that
//! user can enter), and `baton` proves it in the ordinary link handshake. Elsewhere, pass
//! `--token-file`.

mod client;
mod table;
mod top;

use baton_messages::protocol::StatusScope;
use baton_messages::status::{DEFAULT_STATUS_ENTRIES, MAX_STATUS_ENTRIES};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// See who pins what in a running Baton node.
#[derive(Debug, Parser)]
#[command(name = "baton", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// What a node holds and who holds what of it: buffers, leases per holder (pid, bytes
    /// pinned, oldest lease), quarantines, orphaned leases, import cache, links, children.
    Status {
        /// The node's socket (the renderer prints its root's).
        socket: PathBuf,
        /// The session token's file (default: `<SOCKET>.token`, which the node writes).
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// Also ask every node linked to it (a supervision root answers for its tree).
        #[arg(long)]
        tree: bool,
        /// JSON instead of a table (keys include buffers, leases, pinned_bytes, peers,
        /// quarantined, cache).
        #[arg(long)]
        json: bool,
        /// Entries per list (each list says how many it left out).
        #[arg(long, default_value_t = DEFAULT_STATUS_ENTRIES,
              value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_STATUS_ENTRIES)))]
        limit: u32,
        /// How long to wait for the answer, in seconds.
        #[arg(long, default_value_t = 10)]
        timeout: u64,
    },
    /// A live view of a node and the nodes linked to it: pinned bytes per holder, handoffs
    /// per second, quarantined and orphaned counts, a row per node. `q` quits.
    Top {
        /// The node's socket.
        socket: PathBuf,
        /// The session token's file (default: `<SOCKET>.token`).
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// Only this node, not the nodes linked to it.
        #[arg(long)]
        node_only: bool,
        /// Print one frame as text after a few refreshes, without a terminal.
        #[arg(long)]
        once: bool,
        /// With --once: the screen's size, WIDTHxHEIGHT.
        #[arg(long, default_value = "110x32", value_parser = parse_size)]
        size: (u16, u16),
        /// With --once: refreshes before the frame is printed (a second apart; two or more
        /// give a handoff rate).
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=600))]
        samples: u32,
    },
    /// Remove the named host segments (`BATON_HOST=named`) whose owners are dead; never a
    /// live owner's. Then the socket directories dead nodes left (`baton-…` directories,
    /// private, holding only sockets nobody listens on and their tokens), never one where
    /// a node listens.
    Sweep {
        /// The segments' namespace (default: `BATON_SHM_NAMESPACE`, else `baton`).
        #[arg(long)]
        namespace: Option<String>,
        /// Where socket directories are looked for (default: the temporary directory,
        /// `TMPDIR` else `/tmp`).
        #[arg(long)]
        sockets_in: Option<PathBuf>,
        /// Socket directories younger than this many seconds are kept (a node may be
        /// starting in one).
        #[arg(long, default_value_t = 60)]
        min_age: u64,
        /// Only list them.
        #[arg(long)]
        dry_run: bool,
    },
}

fn parse_size(s: &str) -> Result<(u16, u16), String> {
    let (w, h) = s.split_once('x').ok_or("WIDTHxHEIGHT")?;
    let w: u16 = w.parse().map_err(|e| format!("width: {e}"))?;
    let h: u16 = h.parse().map_err(|e| format!("height: {e}"))?;
    if w < 40 || h < 16 {
        return Err("at least 40x16".into());
    }
    Ok((w, h))
}

fn scope(tree: bool) -> StatusScope {
    if tree {
        StatusScope::Tree
    } else {
        StatusScope::Node
    }
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Status {
            socket,
            token_file,
            tree,
            json,
            limit,
            timeout,
        } => {
            let mut link = client::AdminLink::connect(&socket, token_file.as_deref())?;
            let status = link.status(scope(tree), limit, Duration::from_secs(timeout))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{}", table::render(&status));
            }
        }
        Command::Top {
            socket,
            token_file,
            node_only,
            once,
            size,
            samples,
        } => {
            if once {
                print!(
                    "{}",
                    top::once(
                        &socket,
                        token_file.as_deref(),
                        scope(!node_only),
                        samples,
                        size
                    )?
                );
            } else {
                // Check the node answers before taking over the terminal.
                client::AdminLink::connect(&socket, token_file.as_deref())?;
                top::run(&socket, token_file.as_deref(), scope(!node_only))?;
            }
        }
        Command::Sweep {
            namespace,
            sockets_in,
            min_age,
            dry_run,
        } => {
            let ns = namespace.unwrap_or_else(|| {
                std::env::var(baton_ipc::host::NAMESPACE_ENV)
                    .unwrap_or_else(|_| baton_ipc::host::DEFAULT_NAMESPACE.to_owned())
            });
            if dry_run {
                for s in baton_ipc::host::list_segments(&ns)? {
                    println!(
                        "{}  {}  owner pid {} ({:?})",
                        s.name,
                        table::bytes(s.size),
                        s.owner_pid,
                        s.owner
                    );
                }
            } else {
                let report = baton_ipc::host::sweep(&ns)?;
                for name in &report.removed {
                    println!("removed {name}");
                }
                println!(
                    "namespace {ns}: removed {} segments ({}) of dead owners, kept {} of live ones",
                    report.removed.len(),
                    table::bytes(report.removed_bytes),
                    report.kept
                );
            }
            let parent = sockets_in.unwrap_or_else(std::env::temp_dir);
            let report =
                baton_ipc::link::sweep_dead_dirs(&parent, Duration::from_secs(min_age), !dry_run)?;
            let verb = if dry_run { "would remove" } else { "removed" };
            for path in &report.removed {
                println!("{verb} {}", path.display());
            }
            println!(
                "sockets in {}: {verb} {} of dead nodes, kept {}",
                parent.display(),
                report.removed.len(),
                report.kept
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("baton: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["baton", "status", "/s", "--tree", "--json"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Status {
                tree: true,
                json: true,
                limit: DEFAULT_STATUS_ENTRIES,
                ..
            }
        ));
        assert!(Cli::try_parse_from(["baton", "status", "/s", "--limit", "0"]).is_err());
        assert!(Cli::try_parse_from(["baton", "top", "/s", "--size", "10x2"]).is_err());
        assert!(Cli::try_parse_from(["baton", "frobnicate"]).is_err());
    }
}
