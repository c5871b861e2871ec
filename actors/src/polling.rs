//! Runtimes whose thread polls link rings before it parks (issue 48): where a node's
//! links read shared-memory rings ([`NodeConfig::ring`](crate::NodeConfig::ring)), their
//! readers run on the actix system (or arbiter) that made the links. A reader polls its
//! ring for a short window before sleeping on the doorbell only when that thread's tokio
//! runtime calls [`baton_ipc::ring::before_park`] when it parks; these build such
//! runtimes. Without the hook a ring still carries every frame, each costing a doorbell
//! wakeup.

/// A current-thread tokio runtime (I/O and timers on) whose `on_thread_park` hook polls
/// the rings its link readers wait on ([`baton_ipc::ring::park`]). For an arbiter:
/// `actix::Arbiter::with_tokio_rt(|| ring_polling_runtime().expect("runtime"))`.
///
/// # Errors
/// The runtime cannot be built (its I/O driver cannot be made).
pub fn ring_polling_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(baton_ipc::ring::before_park)
        .build()
}

/// An actix system on [`ring_polling_runtime`]: what `actix::System::new()` gives,
/// with ring polling. Run a node whose links use rings on it:
///
/// ```no_run
/// let system = baton_actors::ring_polling_system()?;
/// system.block_on(async {
///     // let node = Node::with_config(NodeConfig::new(session).ring(Some(1 << 20)), backend);
/// });
/// # Ok::<_, std::io::Error>(())
/// ```
///
/// # Errors
/// The runtime cannot be built.
pub fn ring_polling_system() -> std::io::Result<actix::SystemRunner> {
    let runtime = ring_polling_runtime()?;
    Ok(actix::System::with_tokio_rt(move || runtime))
}
