//! Process identity and liveness, from `/proc`.
//!
//! A pid alone does not name a process: pids are reused. Baton names a process by
//! (boot id, pid, start time in clock ticks since boot), which no later process can share.

use baton_messages::{BootId, ProcessId};
use std::sync::OnceLock;

/// The calling process's identity (computed once).
pub fn current() -> ProcessId {
    static ME: OnceLock<ProcessId> = OnceLock::new();
    *ME.get_or_init(|| {
        let pid = std::process::id();
        ProcessId {
            boot: boot_id(),
            pid,
            // Reading our own stat cannot fail on Linux; 0 still names us within this boot.
            start_ticks: start_ticks(pid).unwrap_or(0),
        }
    })
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`); all zeros where unreadable.
pub fn boot_id() -> BootId {
    static BOOT: OnceLock<BootId> = OnceLock::new();
    *BOOT.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .and_then(|s| parse_uuid(&s))
            .map(BootId)
            .unwrap_or(BootId([0; 16]))
    })
}

fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s.trim().bytes().filter(|&b| b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// What `/proc/<pid>/stat` says of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    state: char,
    start_ticks: u64,
}

fn stat(pid: u32) -> std::io::Result<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&text).ok_or_else(|| std::io::Error::other("unparsable /proc/<pid>/stat"))
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) may hold spaces and parentheses,
/// so fields are counted from the last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // `rest` starts at field 3 (state); start time is field 22.
    let start_ticks = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start_ticks })
}

/// A process's start time in clock ticks since boot, if it exists.
pub fn start_ticks(pid: u32) -> Option<u64> {
    stat(pid).ok().map(|s| s.start_ticks)
}

/// Whether a process is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// It runs (or is stopped), and is the same process (same start time).
    Alive,
    /// It exited, is a zombie, or its pid now belongs to another process.
    Dead,
    /// `/proc` could not tell (e.g. mounted with `hidepid`): treat as alive.
    Unknown,
}

/// Whether `process` is alive. A process of another boot is dead by definition.
pub fn liveness(process: &ProcessId) -> Liveness {
    if process.boot != boot_id() {
        return Liveness::Dead;
    }
    liveness_of(process.pid, process.start_ticks)
}

/// Whether the process that had `pid` and started at `start_ticks` is alive.
pub fn liveness_of(pid: u32, start_ticks: u64) -> Liveness {
    match stat(pid) {
        Ok(s) if s.start_ticks != start_ticks || s.state == 'Z' || s.state == 'X' => Liveness::Dead,
        Ok(_) => Liveness::Alive,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Liveness::Dead,
        Err(_) => Liveness::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_hostile_command_names() {
        let line = "1234 (a) b) (c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                state: 'S',
                start_ticks: 987654
            })
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn we_are_alive_and_a_changed_start_time_is_dead() {
        let me = current();
        assert_eq!(me.pid, std::process::id());
        assert_eq!(liveness(&me), Liveness::Alive);
        assert_eq!(liveness_of(me.pid, me.start_ticks + 1), Liveness::Dead);
        assert_eq!(liveness_of(u32::MAX - 7, 0), Liveness::Dead);
        let other_boot = ProcessId {
            boot: BootId([0xff; 16]),
            ..me
        };
        assert_eq!(liveness(&other_boot), Liveness::Dead);
    }

    #[test]
    fn boot_id_parses() {
        assert_eq!(
            parse_uuid("01234567-89ab-cdef-0123-456789abcdef\n"),
            Some([
                0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
                0xcd, 0xef
            ])
        );
        assert_ne!(boot_id(), BootId([0; 16]));
    }
}
