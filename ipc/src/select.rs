//! Choosing a backend at run time.

use crate::cuda::{self, CudaBackend};
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
    /// Host shared memory, in the flavor [`HOST_ENV`](crate::host::HOST_ENV) picks
    /// (sealed memfds by default on Linux).
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

    /// Makes the chosen backend. CUDA is made by [`CudaBackend::from_env`] (device
    /// [`cuda::DEVICE_ENV`], export mode [`cuda::EXPORT_ENV`]).
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when CUDA is forced and absent, with the reason;
    /// unparsable CUDA variables, also under `Auto` when a GPU is present.
    pub fn build(self) -> Result<SharedBackend> {
        match self {
            Self::Host => Ok(Arc::new(HostBackend::new()?)),
            Self::Cuda => CudaBackend::from_env()
                .map(|b| Arc::new(b) as SharedBackend)
                .map_err(|e| match e {
                    Error::BackendUnavailable { reason, .. } => Error::BackendUnavailable {
                        backend: "cuda",
                        reason: format!("{BACKEND_ENV}=cuda asks for it, but {reason}"),
                    },
                    other => other,
                }),
            Self::Auto => match cuda::probe() {
                Ok(_) => match CudaBackend::from_env() {
                    Ok(b) => Ok(Arc::new(b)),
                    Err(Error::Cuda { op, code }) => {
                        tracing::warn!(op, %code, "a GPU is present but unusable; using the host backend");
                        Ok(Arc::new(HostBackend::new()?))
                    }
                    Err(e) => Err(e),
                },
                Err(e) => {
                    tracing::debug!(reason = %e, "no CUDA; using the host backend");
                    Ok(Arc::new(HostBackend::new()?))
                }
            },
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse() {
        assert_eq!(BackendChoice::parse("CUDA"), Some(BackendChoice::Cuda));
        assert_eq!(BackendChoice::parse(""), Some(BackendChoice::Auto));
        assert_eq!(BackendChoice::parse("host"), Some(BackendChoice::Host));
        assert_eq!(BackendChoice::parse("gpu"), None);
    }

    /// Forcing CUDA where there is none fails and says why; `Auto` falls back to host.
    #[test]
    fn forced_cuda_without_a_gpu_says_why_and_auto_falls_back() {
        if cuda::probe().is_ok() {
            // A GPU machine: both pick CUDA.
            assert_eq!(BackendChoice::Auto.build().unwrap().name(), "cuda");
            assert_eq!(BackendChoice::Cuda.build().unwrap().name(), "cuda");
            return;
        }
        let err = BackendChoice::Cuda.build().unwrap_err();
        let msg = err.to_string();
        assert!(matches!(
            err,
            Error::BackendUnavailable {
                backend: "cuda",
                ..
            }
        ));
        assert!(msg.contains("BATON_BACKEND=cuda"), "{msg}");
        assert!(
            msg.contains("libcuda") || msg.contains("no CUDA device"),
            "{msg}"
        );
        assert_eq!(BackendChoice::Auto.build().unwrap().name(), "host");
    }
}
