//! Choosing a backend at run time.

use crate::host::HostBackend;
use crate::{Error, Result, SharedBackend};
use std::sync::Arc;

/// The environment variable that forces a backend: `host`, `cuda` or `auto` (the default).
pub const BACKEND_ENV: &str = "BATON_BACKEND";

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when a driver and a device are present, else host.
    Auto,
    /// Host shared memory.
    Host,
    /// CUDA device memory; an error if unavailable.
    Cuda,
}

impl BackendChoice {
    /// Parses `host`, `cuda` or `auto`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(Self::Auto),
            "host" => Some(Self::Host),
            "cuda" => Some(Self::Cuda),
            _ => None,
        }
    }

    /// The choice in [`BACKEND_ENV`], `Auto` if unset.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] if it holds something else.
    pub fn from_env() -> Result<Self> {
        match std::env::var(BACKEND_ENV) {
            Err(_) => Ok(Self::Auto),
            Ok(v) => Self::parse(&v).ok_or_else(|| Error::BackendUnavailable {
                backend: "?",
                reason: format!("{BACKEND_ENV}={v:?} is not one of host, cuda, auto"),
            }),
        }
    }

    /// Makes the chosen backend.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when CUDA is forced and absent, with the reason.
    pub fn build(self) -> Result<SharedBackend> {
        match self {
            Self::Host => Ok(Arc::new(HostBackend::new()?)),
            Self::Cuda => Err(cuda_unavailable()),
            Self::Auto => Ok(Arc::new(HostBackend::new()?)),
        }
    }
}

fn cuda_unavailable() -> Error {
    Error::BackendUnavailable {
        backend: "cuda",
        reason: "this build has no CUDA backend yet".into(),
    }
}

/// The backend [`BACKEND_ENV`] asks for, `Auto` by default: CUDA when a driver and a
/// device are present, else host.
///
/// # Errors
/// As [`BackendChoice::build`].
pub fn auto() -> Result<SharedBackend> {
    BackendChoice::from_env()?.build()
}
