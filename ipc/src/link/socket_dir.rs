//! [`SocketDir`]: a directory only its owner can enter, to hold link sockets.

use crate::{Error, Result};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// A directory for sockets that only our uid can enter (mode `0700`, owned by us, not a
/// symlink). Sockets inside it are unreachable to other users whatever their own mode.
#[derive(Debug, Clone)]
pub struct SocketDir {
    path: PathBuf,
}

impl SocketDir {
    /// Where sockets go by default: `$XDG_RUNTIME_DIR/baton`, else `/tmp/baton-<uid>`.
    pub fn default_path() -> PathBuf {
        Self::default_path_for(
            std::env::var_os("XDG_RUNTIME_DIR"),
            rustix::process::geteuid().as_raw(),
        )
    }

    /// [`default_path`](Self::default_path) for this runtime directory and uid.
    fn default_path_for(runtime_dir: Option<std::ffi::OsString>, uid: u32) -> PathBuf {
        match runtime_dir {
            Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("baton"),
            _ => PathBuf::from(format!("/tmp/baton-{uid}")),
        }
    }

    /// Creates the directory (its parent must exist) with mode `0700`, or checks an
    /// existing one is private.
    ///
    /// # Errors
    /// [`Error::InsecureSocketDir`] if it exists but is a symlink, not ours, or reachable
    /// by group or others; [`Error::Io`] if it cannot be made.
    pub fn create(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io("creating the socket directory")(e)),
        }
        Self::check(&path)?;
        Ok(Self { path })
    }

    /// Opens the default directory ([`default_path`](Self::default_path)).
    ///
    /// # Errors
    /// As [`create`](Self::create).
    pub fn default_dir() -> Result<Self> {
        Self::create(Self::default_path())
    }

    fn check(path: &Path) -> Result<()> {
        let insecure = |reason| Error::InsecureSocketDir {
            path: path.to_owned(),
            reason,
        };
        let meta = std::fs::symlink_metadata(path)
            .map_err(Error::io("inspecting the socket directory"))?;
        if meta.file_type().is_symlink() {
            return Err(insecure("it is a symbolic link"));
        }
        if !meta.is_dir() {
            return Err(insecure("it is not a directory"));
        }
        if meta.uid() != rustix::process::geteuid().as_raw() {
            return Err(insecure("another user owns it"));
        }
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(insecure("group or others have access (want mode 0700)"));
        }
        Ok(())
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path of the socket called `name` in it.
    pub fn socket(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

/// What [`sweep_dead_dirs`] removed and kept.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SocketSweepReport {
    /// Socket directories of dead nodes that were removed (with everything in them), and
    /// dead sockets removed from the default directory, which itself stays.
    pub removed: Vec<PathBuf>,
    /// Directories left: a node still listens in them, they are younger than the minimum
    /// age, or they hold something that is not a socket or a socket's token.
    pub kept: usize,
}

/// How deep [`sweep_dead_dirs`] looks into a socket directory (the renderer's root keeps
/// the compositor's sockets one level down).
const SWEEP_DEPTH: usize = 3;

/// Removes the socket directories that dead nodes left in `parent` (a node killed before
/// it could remove its own: `/tmp/baton-renderer-<pid>/`, a test's temporary directory):
/// each directory in `parent` named `baton-…`, ours and private (mode `0700`, as a
/// [`SocketDir`] is), older than `min_age`, holding only sockets, their `.token` files
/// and directories of the same — and no socket a process still listens on. A socket is
/// taken for dead only when a connection to it is refused (`ECONNREFUSED`: nobody
/// listens); one listed as bound in `/proc/net/unix` is taken for live without one.
/// Anything else is kept: a directory with other files is not Baton's to judge. The
/// default directory ([`SocketDir::default_path`]) is never removed, only the dead
/// sockets in it (and their tokens). With `remove` false nothing is removed: the report
/// says what would be (a dry run).
///
/// # Errors
/// [`Error::Io`] if `parent` cannot be read. Entries that vanish or cannot be removed
/// meanwhile are kept, not errors.
pub fn sweep_dead_dirs(
    parent: &Path,
    min_age: std::time::Duration,
    remove: bool,
) -> Result<SocketSweepReport> {
    let bound = bound_socket_paths();
    sweep_with(parent, &SocketDir::default_path(), &bound, min_age, remove)
}

/// [`sweep_dead_dirs`], with `default` for the default directory and `bound` for the
/// sockets `/proc/net/unix` lists (tests name their own).
fn sweep_with(
    parent: &Path,
    default: &Path,
    bound: &std::collections::HashSet<PathBuf>,
    min_age: std::time::Duration,
    remove: bool,
) -> Result<SocketSweepReport> {
    let mut report = SocketSweepReport::default();
    let me = rustix::process::geteuid().as_raw();
    let entries =
        std::fs::read_dir(parent).map_err(Error::io("reading the socket directories' parent"))?;
    for entry in entries.flatten() {
        let path = entry.path();
        let ours = entry.file_name().to_string_lossy().starts_with("baton-")
            && std::fs::symlink_metadata(&path)
                .is_ok_and(|m| m.is_dir() && m.uid() == me && m.permissions().mode() & 0o077 == 0);
        if !ours {
            continue;
        }
        let Some(contents) = socket_dir_contents(&path, SWEEP_DEPTH) else {
            report.kept += 1;
            continue;
        };
        let young = contents
            .times
            .iter()
            .any(|t| t.elapsed().map_or(true, |age| age < min_age));
        let live = |socket: &PathBuf| bound.contains(socket) || !refused(socket);
        if path == default {
            for socket in contents.sockets.iter().filter(|s| !live(s)) {
                if !remove {
                    report.removed.push(socket.clone());
                } else if std::fs::remove_file(socket).is_ok() {
                    let _ = std::fs::remove_file(token_of(socket));
                    report.removed.push(socket.clone());
                }
            }
            report.kept += 1;
        } else if young || contents.sockets.iter().any(live) {
            report.kept += 1;
        } else if !remove {
            report.removed.push(path);
        } else if std::fs::remove_dir_all(&path).is_ok() {
            tracing::info!(dir = %path.display(), "swept the socket directory of a dead node");
            report.removed.push(path);
        } else {
            report.kept += 1;
        }
    }
    Ok(report)
}

/// The sockets of a directory tree, and the modification times of it and everything in
/// it; `None` if it holds anything but directories, sockets and `.token` files, or is
/// deeper than `depth`.
struct DirContents {
    sockets: Vec<PathBuf>,
    times: Vec<std::time::SystemTime>,
}

fn socket_dir_contents(dir: &Path, depth: usize) -> Option<DirContents> {
    use std::os::unix::fs::FileTypeExt;
    let mut contents = DirContents {
        sockets: Vec::new(),
        times: vec![std::fs::symlink_metadata(dir).ok()?.modified().ok()?],
    };
    for entry in std::fs::read_dir(dir).ok()? {
        let entry = entry.ok()?;
        let meta = std::fs::symlink_metadata(entry.path()).ok()?;
        contents.times.push(meta.modified().ok()?);
        let kind = meta.file_type();
        if kind.is_socket() {
            contents.sockets.push(entry.path());
        } else if kind.is_file() && entry.file_name().to_string_lossy().ends_with(".token") {
        } else if kind.is_dir() && depth > 1 {
            let inner = socket_dir_contents(&entry.path(), depth - 1)?;
            contents.sockets.extend(inner.sockets);
            contents.times.extend(inner.times);
        } else {
            return None;
        }
    }
    Some(contents)
}

/// Whether a connection to the socket at `path` is refused: nobody listens on it.
fn refused(path: &Path) -> bool {
    matches!(
        std::os::unix::net::UnixStream::connect(path),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// The paths of the Unix sockets bound in this network namespace (`/proc/net/unix`).
fn bound_socket_paths() -> std::collections::HashSet<PathBuf> {
    std::fs::read_to_string("/proc/net/unix")
        .unwrap_or_default()
        .lines()
        .skip(1)
        // `Num RefCount Protocol Flags Type St Inode Path`
        .filter_map(|line| line.split_whitespace().nth(7))
        .filter(|p| p.starts_with('/'))
        .map(PathBuf::from)
        .collect()
}

/// The admin token a node writes beside its socket (`<socket>.token`).
fn token_of(socket: &Path) -> PathBuf {
    let mut name = socket.as_os_str().to_owned();
    name.push(".token");
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::time::Duration;

    #[test]
    fn the_default_path_is_the_runtime_dir_else_a_tmp_dir_of_the_uid() {
        let path = |dir: Option<&str>| SocketDir::default_path_for(dir.map(Into::into), 1234);
        assert_eq!(
            path(Some("/run/user/1234")),
            Path::new("/run/user/1234/baton")
        );
        assert_eq!(path(Some("")), Path::new("/tmp/baton-1234"));
        assert_eq!(path(None), Path::new("/tmp/baton-1234"));
        let here = SocketDir::default_path();
        assert!(
            here.is_absolute() && here.to_string_lossy().contains("baton"),
            "{here:?}"
        );
    }

    #[test]
    fn create_makes_a_private_dir_once_and_says_when_it_cannot() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("sockets");
        SocketDir::create(&dir).unwrap();
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        SocketDir::create(&dir).expect("an existing private directory is taken as it is");
        let err = SocketDir::create(tmp.path().join("missing/sockets")).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Io {
                    op: "creating the socket directory",
                    ..
                }
            ),
            "{err:?}"
        );
    }

    /// The default directory is never removed, only its dead sockets and their tokens; a
    /// socket bound but not listening (listed in `/proc/net/unix`, refusing connections)
    /// counts as live.
    #[test]
    fn the_sweep_keeps_the_default_dir_and_its_live_sockets() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let default = private_dir(&root.join("baton-0"));
        dead_socket(&default.join("dead.sock"));
        let _listening = UnixListener::bind(default.join("live.sock")).unwrap();
        let bound = rustix::net::socket(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            None,
        )
        .unwrap();
        let addr = rustix::net::SocketAddrUnix::new(default.join("bound.sock")).unwrap();
        rustix::net::bind(&bound, &addr).unwrap();
        assert!(refused(&default.join("bound.sock")), "bound, not listening");

        let bound = bound_socket_paths();
        let planned = sweep_with(root, &default, &bound, Duration::ZERO, false).unwrap();
        assert_eq!(planned.removed, [default.join("dead.sock")], "{planned:?}");
        assert_eq!(planned.kept, 1, "{planned:?}");
        assert!(
            default.join("dead.sock").exists(),
            "a dry run removes nothing"
        );

        let report = sweep_with(root, &default, &bound, Duration::ZERO, true).unwrap();
        assert_eq!(report.removed, [default.join("dead.sock")], "{report:?}");
        assert_eq!(report.kept, 1, "{report:?}");
        assert!(!default.join("dead.sock").exists());
        assert!(
            !token_of(&default.join("dead.sock")).exists(),
            "its token went too"
        );
        for kept in ["live.sock", "bound.sock"] {
            assert!(default.join(kept).exists(), "{kept}");
        }
    }

    /// Without `/proc/net/unix` (another network namespace's view, or none), a socket is
    /// judged by connecting: one that accepts is live. And a directory deeper than the
    /// sweep looks is not Baton's to judge: kept.
    #[test]
    fn the_sweep_connects_to_judge_a_socket_and_keeps_what_is_too_deep() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let live = private_dir(&root.join("baton-live-1"));
        let _listening = UnixListener::bind(live.join("node.sock")).unwrap();
        let mut deep = private_dir(&root.join("baton-deep-2"));
        for level in ["a", "b", "c"] {
            deep = private_dir(&deep.join(level));
        }
        dead_socket(&deep.join("node.sock"));
        let shallow = private_dir(&root.join("baton-shallow-3"));
        dead_socket(&private_dir(&private_dir(&shallow.join("a")).join("b")).join("node.sock"));
        let nothing_bound = std::collections::HashSet::new();
        let report = sweep_with(
            root,
            &root.join("baton-0"),
            &nothing_bound,
            Duration::ZERO,
            true,
        )
        .unwrap();
        assert_eq!(report.removed, std::slice::from_ref(&shallow), "{report:?}");
        assert_eq!(report.kept, 2, "the live one and the deep one");
        assert!(live.join("node.sock").exists() && deep.join("node.sock").exists());
    }

    /// A socket left as a killed node leaves it: bound, then nobody listening.
    fn dead_socket(path: &Path) {
        drop(UnixListener::bind(path).unwrap());
        std::fs::write(token_of(path), b"token").unwrap();
    }

    fn private_dir(path: &Path) -> PathBuf {
        SocketDir::create(path).unwrap().path().to_owned()
    }

    #[test]
    fn the_sweep_removes_dead_nodes_socket_dirs_and_keeps_live_young_and_foreign_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        // A killed renderer root: its socket, its token, the compositor's below.
        let dead = private_dir(&root.join("baton-renderer-1"));
        dead_socket(&dead.join("root.sock"));
        let inner = private_dir(&dead.join("compositor"));
        dead_socket(&inner.join("compositor.sock"));
        // An empty directory whose node died before it bound.
        let empty = private_dir(&root.join("baton-example-2"));
        // A live node: one socket listening, one dead beside it.
        let live = private_dir(&root.join("baton-live-3"));
        let _listening = UnixListener::bind(live.join("node.sock")).unwrap();
        dead_socket(&live.join("old.sock"));
        // Not Baton's to judge: another file inside, a name not ours, an open mode.
        let foreign = private_dir(&root.join("baton-notes-4"));
        dead_socket(&foreign.join("node.sock"));
        std::fs::write(foreign.join("notes.txt"), b"mine").unwrap();
        let other = private_dir(&root.join("other-5"));
        dead_socket(&other.join("node.sock"));
        let open = root.join("baton-open-6");
        std::fs::create_dir(&open).unwrap();
        dead_socket(&open.join("node.sock"));
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();

        // All of them younger than an hour: nothing goes.
        let report = sweep_dead_dirs(root, Duration::from_secs(3600), true).unwrap();
        assert!(report.removed.is_empty(), "{report:?}");
        assert_eq!(report.kept, 4, "{report:?}");

        // A dry run names what would go and removes nothing.
        let planned = sweep_dead_dirs(root, Duration::ZERO, false).unwrap();
        assert_eq!(planned.removed.len(), 2, "{planned:?}");
        assert!(dead.exists() && empty.exists());

        let report = sweep_dead_dirs(root, Duration::ZERO, true).unwrap();
        let mut removed = report.removed.clone();
        removed.sort();
        assert_eq!(removed, [empty.clone(), dead.clone()], "{report:?}");
        let mut planned = planned.removed;
        planned.sort();
        assert_eq!(planned, removed);
        assert_eq!(report.kept, 2, "the live node's and the foreign one");
        assert!(!dead.exists() && !empty.exists());
        for kept in [live.join("node.sock"), live.join("old.sock")] {
            assert!(kept.exists(), "{}", kept.display());
        }
        assert!(foreign.join("notes.txt").exists());
        assert!(other.join("node.sock").exists());
        assert!(open.join("node.sock").exists());
    }

    /// A dead node's directory that cannot be removed is kept, and counted so. What stops
    /// the removal: for a user, a subdirectory it may not write; for root (whom modes do
    /// not stop), a token file marked immutable (`chattr +i`; where the file system or the
    /// container refuses that, the test says so and checks nothing).
    #[test]
    fn a_dead_nodes_dir_that_cannot_be_removed_is_kept_and_counted() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let dead = private_dir(&root.join("baton-stuck-1"));
        let sub = private_dir(&dead.join("worker"));
        dead_socket(&sub.join("worker.sock"));
        let token = token_of(&sub.join("worker.sock"));
        let as_root = rustix::process::geteuid().is_root();
        let chattr = |flag: &str| {
            std::process::Command::new("chattr")
                .arg(flag)
                .arg(&token)
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if as_root {
            if !chattr("+i") {
                eprintln!("skipped: running as root and `chattr +i` is refused here");
                return;
            }
        } else {
            std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o500)).unwrap();
        }
        let report = sweep_with(
            root,
            &root.join("baton-0"),
            &std::collections::HashSet::new(),
            Duration::ZERO,
            true,
        );
        // Undo first, so that the temporary directory goes whatever the verdict.
        if as_root {
            assert!(chattr("-i"), "chattr -i");
        } else {
            std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o700)).unwrap();
        }
        let report = report.unwrap();
        assert!(report.removed.is_empty(), "{report:?}");
        assert_eq!(report.kept, 1, "{report:?}");
        assert!(token.exists());
    }

    #[test]
    fn creates_private_and_refuses_open_dirs() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = SocketDir::create(tmp.path().join("s")).unwrap();
        let mode = std::fs::metadata(dir.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        // Reopening a private one is fine.
        SocketDir::create(dir.path()).unwrap();

        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(
            SocketDir::create(&open),
            Err(Error::InsecureSocketDir { .. })
        ));

        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        assert!(matches!(
            SocketDir::create(&link),
            Err(Error::InsecureSocketDir { .. })
        ));
    }
}
