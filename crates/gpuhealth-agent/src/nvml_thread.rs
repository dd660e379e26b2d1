//! NVML on a thread of its own: every call the agent makes goes through it,
//! with a deadline, so a hung driver never blocks the agent's loop (it then
//! says NVML is hung, and keeps serving). The thread also follows NVML's
//! critical-XID events, and lets go of NVML entirely (every device handle
//! and event registration) while a GPU is reset: the driver refuses a reset
//! while anything holds the GPU, the agent included.

use std::{
    ffi::OsString,
    sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError},
    time::Duration,
};

use nvml_wrapper::{EventSet, Nvml, bitmasks::event::EventTypes, enums::event::XidError};
use tokio::sync::oneshot;

use crate::{
    driver_root::DriverRoot,
    nvml::{self, DeviceReading, NvmlUnavailable},
};

/// Where NVML is loaded from.
#[derive(Clone, Debug)]
pub enum NvmlLibrary {
    /// A file name, looked up on the library path as `dlopen` does, or a
    /// path.
    Named(OsString),
    /// A driver root's, found in it on each try: the driver container may
    /// lay the root out after the agent starts.
    InDriverRoot(DriverRoot),
}

impl NvmlLibrary {
    /// Loads and initialises NVML from here.
    pub fn open(&self) -> Result<Nvml, NvmlUnavailable> {
        match self {
            NvmlLibrary::Named(name) => nvml::open(name),
            NvmlLibrary::InDriverRoot(root) => nvml::open(
                root.nvml_library()
                    .map_err(NvmlUnavailable::Init)?
                    .as_os_str(),
            ),
        }
    }
}

/// How long the thread waits for an event before looking for work again.
const EVENT_WAIT_MS: u32 = 200;
/// How long it waits before trying to load NVML again after a failure.
const RETRY: Duration = Duration::from_secs(10);

/// Where device readings come from: NVML on its thread, or a recorded
/// device model in tests.
pub trait Gpus: Send + Sync {
    fn read(&self) -> impl Future<Output = Result<Vec<DeviceReading>, NvmlUnavailable>> + Send;
    /// Lets go of every device, until [`Gpus::retake`].
    fn release(&self) -> impl Future<Output = Result<(), NvmlUnavailable>> + Send;
    fn retake(&self) -> impl Future<Output = Result<(), NvmlUnavailable>> + Send;
}

/// What NVML's event set tells the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XidNews<'a> {
    /// Registered on every GPU: each Xid from now on is told.
    Listening,
    /// No longer (let go for a reset, or NVML went away).
    Deaf,
    /// An Xid on the GPU at this PCI address.
    Xid { pci_bus_id: &'a str, code: u32 },
}

enum Job {
    Read(oneshot::Sender<Result<Vec<DeviceReading>, NvmlUnavailable>>),
    Release(oneshot::Sender<()>),
    Retake(oneshot::Sender<Result<(), NvmlUnavailable>>),
}

/// The handle on the NVML thread.
pub struct NvmlThread {
    jobs: SyncSender<Job>,
    deadline: Duration,
}

impl NvmlThread {
    /// Starts the thread: it loads NVML from `library` (retrying while it
    /// cannot), registers for critical-XID events on every GPU and tells
    /// `on_xid` of each, and of when it starts and stops listening. Each
    /// call waits `deadline` at most for an answer.
    pub fn start(
        library: NvmlLibrary,
        deadline: Duration,
        on_xid: impl Fn(XidNews<'_>) + Send + 'static,
    ) -> NvmlThread {
        // One call waits in the queue at most: while NVML hangs, later
        // calls fail at once rather than pile up.
        let (jobs, queue) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("nvml".into())
            .spawn(move || serve(&library, &queue, &on_xid))
            .map(|_| ())
            .unwrap_or_else(|e| tracing::error!(error = %e, "starting the NVML thread"));
        NvmlThread { jobs, deadline }
    }

    async fn ask<T>(
        &self,
        job: impl FnOnce(oneshot::Sender<T>) -> Job,
    ) -> Result<T, NvmlUnavailable> {
        let (tx, rx) = oneshot::channel();
        match self.jobs.try_send(job(tx)) {
            Ok(()) => {}
            // The agent asks one thing at a time: a full queue is a call
            // that has not returned past its deadline, and the one after it.
            Err(TrySendError::Full(_)) => return Err(NvmlUnavailable::Hung(self.deadline)),
            Err(TrySendError::Disconnected(_)) => return Err(NvmlUnavailable::Stopped),
        }
        match tokio::time::timeout(self.deadline, rx).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(_)) => Err(NvmlUnavailable::Stopped),
            Err(_) => Err(NvmlUnavailable::Hung(self.deadline)),
        }
    }
}

impl Gpus for NvmlThread {
    async fn read(&self) -> Result<Vec<DeviceReading>, NvmlUnavailable> {
        self.ask(Job::Read).await?
    }

    async fn release(&self) -> Result<(), NvmlUnavailable> {
        self.ask(Job::Release).await
    }

    async fn retake(&self) -> Result<(), NvmlUnavailable> {
        self.ask(Job::Retake).await?
    }
}

/// A recorded device model: readings taken on real hardware, replayed.
pub struct Recorded(pub Vec<DeviceReading>);

impl Gpus for Recorded {
    async fn read(&self) -> Result<Vec<DeviceReading>, NvmlUnavailable> {
        Ok(self.0.clone())
    }

    async fn release(&self) -> Result<(), NvmlUnavailable> {
        Ok(())
    }

    async fn retake(&self) -> Result<(), NvmlUnavailable> {
        Ok(())
    }
}

/// The thread's life: hold NVML and answer calls, let go of it when asked,
/// take it again when asked.
fn serve(library: &NvmlLibrary, jobs: &Receiver<Job>, on_xid: &dyn Fn(XidNews<'_>)) {
    let mut retaking: Option<oneshot::Sender<Result<(), NvmlUnavailable>>> = None;
    loop {
        let nvml = match library.open() {
            Ok(n) => n,
            Err(e) => {
                if let Some(tx) = retaking.take() {
                    let _ = tx.send(Err(e.clone()));
                }
                if !answer_for(jobs, RETRY, &Err(e)) {
                    return;
                }
                continue;
            }
        };
        if let Some(tx) = retaking.take() {
            let _ = tx.send(Ok(()));
        }
        let released = {
            let events = register(&nvml);
            if events.is_some() {
                on_xid(XidNews::Listening);
            }
            let held = hold(&nvml, events.as_ref(), jobs, on_xid);
            on_xid(XidNews::Deaf);
            match held {
                Some(tx) => tx,
                None => return,
            }
            // The event set, then NVML, are dropped here: every handle closed.
        };
        drop(nvml);
        let _ = released.send(());
        // Let go until asked to take NVML again.
        loop {
            match jobs.recv() {
                Ok(Job::Retake(tx)) => {
                    retaking = Some(tx);
                    break;
                }
                Ok(Job::Read(tx)) => {
                    let _ = tx.send(Err(NvmlUnavailable::Released));
                }
                Ok(Job::Release(tx)) => {
                    let _ = tx.send(());
                }
                Err(_) => return,
            }
        }
    }
}

/// Answers calls while NVML cannot be loaded, for `how_long`; false when the
/// agent has gone.
fn answer_for(jobs: &Receiver<Job>, how_long: Duration, why: &Result<(), NvmlUnavailable>) -> bool {
    let until = std::time::Instant::now() + how_long;
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return true;
        }
        let error = why.clone().err().unwrap_or(NvmlUnavailable::Stopped);
        match jobs.recv_timeout(left) {
            Ok(Job::Read(tx)) => {
                let _ = tx.send(Err(error));
            }
            Ok(Job::Release(tx)) => {
                let _ = tx.send(());
            }
            // Taking it again is what this loop is about to try.
            Ok(Job::Retake(tx)) => {
                let _ = tx.send(Err(error));
                return true;
            }
            Err(RecvTimeoutError::Timeout) => return true,
            Err(RecvTimeoutError::Disconnected) => return false,
        }
    }
}

/// Registers for critical-XID events on every GPU; none if NVML cannot
/// (the kernel log then carries the Xids).
fn register(nvml: &Nvml) -> Option<EventSet<'_>> {
    let attempt = || -> Result<EventSet<'_>, String> {
        let mut set = nvml.create_event_set().map_err(|e| e.to_string())?;
        for i in 0..nvml.device_count().map_err(|e| e.to_string())? {
            let device = nvml.device_by_index(i).map_err(|e| e.to_string())?;
            set = device
                .register_events(EventTypes::CRITICAL_XID_ERROR, set)
                .map_err(|e| format!("GPU {i}: {}", e.error))?;
        }
        Ok(set)
    };
    attempt()
        .inspect_err(|e| {
            tracing::warn!(error = %e, "NVML's XID events are not available; the kernel log carries the Xids")
        })
        .ok()
}

/// Answers calls and follows events until asked to let go: returns whom to
/// tell once it has, or `None` when the agent has gone.
fn hold(
    nvml: &Nvml,
    events: Option<&EventSet<'_>>,
    jobs: &Receiver<Job>,
    on_xid: &dyn Fn(XidNews<'_>),
) -> Option<oneshot::Sender<()>> {
    loop {
        let job = match events {
            Some(_) => match jobs.try_recv() {
                Ok(job) => Some(job),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => return None,
            },
            None => match jobs.recv_timeout(Duration::from_millis(u64::from(EVENT_WAIT_MS))) {
                Ok(job) => Some(job),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return None,
            },
        };
        match job {
            Some(Job::Read(tx)) => {
                let _ = tx.send(nvml::read_all(nvml));
            }
            Some(Job::Release(tx)) => return Some(tx),
            Some(Job::Retake(tx)) => {
                let _ = tx.send(Ok(()));
            }
            None => {}
        }
        if let Some(set) = events {
            match set.wait(EVENT_WAIT_MS) {
                Ok(event) => {
                    let code = match event.event_data {
                        Some(XidError::Value(v)) => u32::try_from(v).ok(),
                        _ => None,
                    };
                    if let (Some(code), Ok(pci)) = (code, event.device.pci_info()) {
                        on_xid(XidNews::Xid {
                            pci_bus_id: &pci.bus_id,
                            code,
                        });
                    }
                }
                Err(nvml_wrapper::error::NvmlError::Timeout) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "waiting for NVML XID events");
                    std::thread::sleep(Duration::from_millis(u64::from(EVENT_WAIT_MS)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::NVML_LIBRARY;

    /// The `nvidia*` device nodes this process has open (under
    /// `GPUHEALTH_DEV_DIR`, `/dev` unless a stand-in says otherwise).
    fn devices_held() -> Vec<String> {
        let dev = std::env::var("GPUHEALTH_DEV_DIR").unwrap_or_else(|_| "/dev".into());
        let prefix = format!("{}/nvidia", dev.trim_end_matches('/'));
        std::fs::read_dir("/proc/self/fd")
            .map(|fds| {
                fds.flatten()
                    .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                    .map(|p| p.display().to_string())
                    .filter(|p| p.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default()
    }

    #[tokio::test]
    async fn without_nvml_every_call_says_why_and_none_blocks() {
        let library = "/nonexistent/libnvidia-ml.so.1";
        let nvml = NvmlThread::start(
            NvmlLibrary::Named(library.into()),
            Duration::from_secs(30),
            |_| {},
        );
        for _ in 0..2 {
            let e = nvml.read().await.expect_err("no NVML");
            assert!(matches!(e, NvmlUnavailable::Init(_)), "{e}");
            assert!(e.to_string().contains(library), "{e}");
        }
    }

    /// A driver root not laid out yet says so, and is looked in again.
    #[tokio::test]
    async fn a_driver_root_without_nvml_says_so() {
        let root =
            std::env::temp_dir().join(format!("gpuhealth-empty-root-{}", std::process::id()));
        std::fs::create_dir_all(&root).expect("an empty root");
        let nvml = NvmlThread::start(
            NvmlLibrary::InDriverRoot(DriverRoot::new(root.clone())),
            Duration::from_secs(30),
            |_| {},
        );
        let e = nvml.read().await.expect_err("an empty root");
        assert!(
            e.to_string().contains(&format!(
                "no {NVML_LIBRARY} in the driver root {}",
                root.display()
            )),
            "{e}"
        );
    }

    /// On a machine with GPUs: NVML and its events hold every GPU's device
    /// node until the thread lets go. (Without one, the e2e resets show the
    /// same against the NVML stand-in: a GPU the agent still held would be
    /// refused by its nvidia-smi.)
    #[tokio::test]
    #[ignore = "needs NVIDIA's NVML and a GPU: cargo test -p gpuhealth-agent -- --ignored on one"]
    async fn the_thread_reads_lets_go_of_every_gpu_and_takes_them_again() {
        let library = std::env::var_os("GPUHEALTH_NVML_LIBRARY").unwrap_or(NVML_LIBRARY.into());
        let nvml = NvmlThread::start(NvmlLibrary::Named(library), Duration::from_secs(30), |_| {});
        let first = nvml.read().await.expect("NVML answers on a GPU node");
        assert!(!first.is_empty(), "NVML lists no GPU");
        assert!(!devices_held().is_empty(), "NVML holds no device node");
        nvml.release().await.expect("let go");
        assert_eq!(nvml.read().await, Err(NvmlUnavailable::Released));
        assert_eq!(
            devices_held(),
            Vec::<String>::new(),
            "a device node still held"
        );
        nvml.retake().await.expect("take again");
        let again = nvml.read().await.expect("read again");
        let uuids = |r: &[DeviceReading]| r.iter().map(|d| d.uuid.clone()).collect::<Vec<_>>();
        assert_eq!(uuids(&again), uuids(&first));
    }
}
