//! The machine a run measured: every figure is printed with it.

use baton::ipc::cuda::{self, CudaBackend, CudaExport};
use serde_json::{Value, json};
use std::process::Command;

#[derive(Debug, Clone)]
pub(crate) struct Gpu {
    pub(crate) name: String,
    pub(crate) memory_gib: f64,
    /// `nvidia-smi`'s driver version, when it is there.
    pub(crate) driver: Option<String>,
    /// Whether the device maps VMM memory shared as POSIX fds (`cuda-vmm` can run).
    pub(crate) vmm: bool,
    /// Whether the device shares memory pools as POSIX fds (`cuda-pool` can run).
    pub(crate) pools: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct Machine {
    pub(crate) cpu: String,
    pub(crate) cores: usize,
    pub(crate) memory_gib: f64,
    pub(crate) kernel: String,
    pub(crate) gpu: Option<Gpu>,
    /// Why there is no GPU, when there is none.
    pub(crate) no_gpu: Option<String>,
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim())
}

fn gpu() -> Result<Gpu, String> {
    cuda::probe().map_err(|e| e.to_string())?;
    let backend = CudaBackend::new(0, CudaExport::Legacy).map_err(|e| e.to_string())?;
    let ctx = backend.context();
    let name = ctx.name().map_err(|e| e.to_string())?;
    let memory = ctx.total_mem().map_err(|e| e.to_string())?;
    let driver = Command::new("nvidia-smi")
        .args(["--query-gpu=driver_version", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(|l| l.trim().to_owned()));
    Ok(Gpu {
        name,
        memory_gib: memory as f64 / (1u64 << 30) as f64,
        driver,
        vmm: backend.vmm_granularity().is_some(),
        pools: backend.pools_supported(),
    })
}

impl Machine {
    pub(crate) fn detect() -> Machine {
        let cpuinfo = read("/proc/cpuinfo");
        let meminfo = read("/proc/meminfo");
        let mem_kib: f64 = field(&meminfo, "MemTotal")
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        let (gpu, no_gpu) = match gpu() {
            Ok(g) => (Some(g), None),
            Err(e) => (None, Some(e)),
        };
        Machine {
            cpu: field(&cpuinfo, "model name")
                .unwrap_or("unknown CPU")
                .to_owned(),
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            memory_gib: mem_kib / (1u64 << 20) as f64,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            gpu,
            no_gpu,
        }
    }

    /// One line: CPU, cores, memory, GPU.
    pub(crate) fn describe(&self) -> String {
        let gpu = match &self.gpu {
            Some(g) => format!(
                "{} ({:.0} GiB{})",
                g.name,
                g.memory_gib,
                g.driver
                    .as_deref()
                    .map(|d| format!(", driver {d}"))
                    .unwrap_or_default()
            ),
            None => "no GPU".to_owned(),
        };
        format!(
            "{} x{} cores, {:.0} GiB RAM, Linux {}; {gpu}",
            self.cpu, self.cores, self.memory_gib, self.kernel
        )
    }

    pub(crate) fn json(&self) -> Value {
        json!({
            "cpu": self.cpu,
            "cores": self.cores,
            "memory_gib": (self.memory_gib * 10.0).round() / 10.0,
            "kernel": self.kernel,
            "gpu": self.gpu.as_ref().map(|g| g.name.clone()),
            "gpu_memory_gib": self.gpu.as_ref().map(|g| g.memory_gib.round()),
            "driver": self.gpu.as_ref().and_then(|g| g.driver.clone()),
            "vmm": self.gpu.as_ref().map(|g| g.vmm),
            "pools": self.gpu.as_ref().map(|g| g.pools),
            "no_gpu_reason": self.no_gpu,
        })
    }
}
