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
        match std::env::var_os("XDG_RUNTIME_DIR") {
            Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("baton"),
            _ => PathBuf::from(format!(
                "/tmp/baton-{}",
                rustix::process::geteuid().as_raw()
            )),
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

#[cfg(test)]
mod tests {
    use super::*;

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
