//! What NVML says of each GPU, read through `libnvidia-ml.so.1`, which is
//! loaded at run time, so the agent builds and its tests run where there is
//! no GPU.
//!
//! Reading and judging are apart: [`read_all`] turns NVML calls into
//! [`DeviceReading`]s, and [`health`] judges a reading with no NVML at all.
//! A reading recorded on real hardware is a test fixture. The agent makes
//! its NVML calls on a thread of their own ([`crate::nvml_thread`]).

use std::ffi::OsStr;

use gpuhealth_api::{
    GpuHealth,
    contract::{GpuEntry, RemappedRows},
};
use nvml_wrapper::{
    Device, Nvml,
    enum_wrappers::device::{EccCounter, MemoryError},
    enums::device::SampleValue,
    error::NvmlError,
    structs::device::FieldId,
};
use serde::{Deserialize, Serialize};

use crate::judgement;

/// The library the NVIDIA Container Toolkit injects and a driver install
/// provides (the unversioned `libnvidia-ml.so` comes only with development
/// packages).
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";

/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`: what the driver says the GPU needs.
const FIELD_RECOVERY_ACTION: FieldId = FieldId(230);
/// `NVML_FI_DEV_REMAPPED_PENDING` and `_FAILURE`: row remapping, read as
/// field values so no raw (unsafe) NVML call is needed.
const FIELD_REMAPPED_PENDING: FieldId = FieldId(144);
const FIELD_REMAPPED_FAILURE: FieldId = FieldId(145);

/// What NVML said about one GPU at one moment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceReading {
    pub index: u32,
    pub uuid: String,
    pub pci_bus_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    /// The N of the GPU's device node `/dev/nvidiaN`: what a process that
    /// holds the GPU has open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<u32>,
    /// Why the device could not be read at all (for example `GpuLost`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_action: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remapped_rows: Option<RemappedRows>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retired_pages_pending: Option<bool>,
    /// Uncorrected ECC errors since the driver loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncorrected_ecc_volatile: Option<u64>,
    /// Whether persistence mode is on: `nvidia-persistenced` then holds
    /// the GPU's device node, and a reset turns it off first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence_mode: Option<bool>,
    /// PIDs of the compute processes on the GPU (a reset waits for none).
    #[serde(default)]
    pub compute_processes: Vec<u32>,
    /// PIDs of the graphics processes on the GPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub graphics_processes: Vec<u32>,
    /// The GPU's MIG devices, when MIG is on: what the kubelet names when it
    /// hands out a MIG slice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<MigDevice>,
    /// What this GPU or driver could not tell, and why (`NotSupported`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreadable: Vec<String>,
}

/// A MIG device: its slot on the GPU (NVML's MIG device index) and UUID.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDevice {
    pub slot: u32,
    pub uuid: String,
}

/// How a GPU stands, from one reading. The Xids are the operator's to judge
/// (with their times); this is the GPU's state now, judged as the kernel
/// log's is ([`crate::judgement`]).
pub fn health(r: &DeviceReading) -> GpuHealth {
    if r.lost.is_some() {
        return GpuHealth::Lost;
    }
    judgement::worst([
        r.recovery_action
            .map_or(GpuHealth::Healthy, judgement::of_recovery_action),
        judgement::of_memory(
            r.remapped_rows,
            r.retired_pages_pending,
            r.uncorrected_ecc_volatile,
        ),
    ])
}

/// Why a GPU that was just reset is not yet back, if it is not: the driver
/// asks for nothing more, and no row remap is pending or failed.
pub fn not_recovered(r: &DeviceReading) -> Option<String> {
    if let Some(lost) = &r.lost {
        return Some(format!("NVML cannot read it ({lost})"));
    }
    if let Some(action) = r.recovery_action.filter(|a| *a != 0) {
        return Some(format!("its recovery action is still {action}"));
    }
    match r.remapped_rows {
        Some(RemappedRows { failure: true, .. }) => Some("a row remap has failed".into()),
        Some(RemappedRows { pending: true, .. }) => Some("a row remap is still pending".into()),
        _ => None,
    }
}

/// The report entry for a reading (no Xids or pods: other parts add them).
pub fn entry(r: &DeviceReading) -> GpuEntry {
    GpuEntry {
        index: r.index,
        uuid: r.uuid.clone(),
        pci_bus_id: r.pci_bus_id.clone(),
        product: r.product.clone(),
        health: health(r),
        xids: Vec::new(),
        recovery_action: r.recovery_action,
        remapped_rows: r.remapped_rows,
        pods: Vec::new(),
        pods_unknown: None,
        offered: None,
    }
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum NvmlUnavailable {
    #[error(
        "NVML could not be loaded or initialised ({0}); is the NVIDIA driver installed, and {NVML_LIBRARY} in the container (the NVIDIA runtime, or --driver-root)?"
    )]
    Init(String),
    #[error("NVML could not count the GPUs: {0}")]
    Count(String),
    #[error("NVML did not answer within {0:?}: the driver may be hung")]
    Hung(std::time::Duration),
    #[error("NVML is let go of for a GPU reset")]
    Released,
    #[error("the NVML thread stopped")]
    Stopped,
}

/// Loads and initialises NVML from `library` (a file name is looked up on
/// the library path, as `dlopen` does).
pub fn open(library: &OsStr) -> Result<Nvml, NvmlUnavailable> {
    Nvml::builder()
        .lib_path(library)
        .init()
        .map_err(|e| NvmlUnavailable::Init(e.to_string()))
}

/// Every GPU now.
pub fn read_all(nvml: &Nvml) -> Result<Vec<DeviceReading>, NvmlUnavailable> {
    let count = nvml
        .device_count()
        .map_err(|e| NvmlUnavailable::Count(e.to_string()))?;
    Ok((0..count).map(|i| read_one(nvml, i)).collect())
}

fn read_one(nvml: &Nvml, index: u32) -> DeviceReading {
    let mut r = DeviceReading {
        index,
        ..Default::default()
    };
    let device = match nvml.device_by_index(index) {
        Ok(d) => d,
        Err(e) => {
            r.lost = Some(e.to_string());
            return r;
        }
    };
    let mut note = |what: &str, e: NvmlError| {
        if matches!(e, NvmlError::GpuLost) {
            r.lost.get_or_insert_with(|| format!("{what}: {e}"));
        } else {
            r.unreadable.push(format!("{what}: {e}"));
        }
    };
    let uuid = device.uuid().map_err(|e| note("uuid", e)).ok();
    let pci = device.pci_info().map_err(|e| note("pci", e)).ok();
    let product = device.name().map_err(|e| note("name", e)).ok();
    let minor = device
        .minor_number()
        .map_err(|e| note("minor number", e))
        .ok();
    let mut fields = [None, None, None];
    match device.field_values_for(&[
        FIELD_RECOVERY_ACTION,
        FIELD_REMAPPED_PENDING,
        FIELD_REMAPPED_FAILURE,
    ]) {
        Ok(samples) => {
            for (slot, (sample, what)) in fields.iter_mut().zip(samples.into_iter().zip([
                "recovery action (field 230)",
                "remapped rows pending (field 144)",
                "remapped rows failure (field 145)",
            ])) {
                match sample.and_then(|s| s.value) {
                    Ok(v) => *slot = as_u64(&v),
                    Err(e) => note(what, e),
                }
            }
        }
        Err(e) => note("field values", e),
    }
    let pending_retired = device
        .are_pages_pending_retired()
        .map_err(|e| note("retired pages pending", e))
        .ok();
    let ecc = device
        .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
        .map_err(|e| note("volatile uncorrected ECC", e))
        .ok();
    let persistence = device
        .is_in_persistent_mode()
        .map_err(|e| note("persistence mode", e))
        .ok();
    let compute = device
        .running_compute_processes()
        .map_err(|e| note("compute processes", e))
        .unwrap_or_default();
    let graphics = device
        .running_graphics_processes()
        .map_err(|e| note("graphics processes", e))
        .unwrap_or_default();
    let mig_devices = mig_devices(&device).unwrap_or_else(|e| {
        note("MIG devices", e);
        Vec::new()
    });
    r.uuid = uuid.unwrap_or_default();
    r.pci_bus_id = pci.map(|p| p.bus_id).unwrap_or_default();
    r.product = product;
    r.minor = minor;
    r.recovery_action = fields[0].and_then(|v| u32::try_from(v).ok());
    r.remapped_rows = match (fields[1], fields[2]) {
        (Some(p), Some(f)) => Some(RemappedRows {
            pending: p != 0,
            failure: f != 0,
        }),
        _ => None,
    };
    r.retired_pages_pending = pending_retired;
    r.uncorrected_ecc_volatile = ecc;
    r.persistence_mode = persistence;
    r.compute_processes = compute.iter().map(|p| p.pid).collect();
    r.graphics_processes = graphics.iter().map(|p| p.pid).collect();
    r.mig_devices = mig_devices;
    r
}

/// A GPU's MIG devices; none when MIG is off or unsupported.
fn mig_devices(device: &Device<'_>) -> Result<Vec<MigDevice>, NvmlError> {
    match device.mig_mode() {
        Ok(mode) if mode.current == 1 => {}
        Ok(_) | Err(NvmlError::NotSupported) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    }
    let slots = device.mig_device_count()?;
    let mut uuids = Vec::new();
    for slot in 0..slots {
        match device.mig_device_by_index(slot) {
            Ok(mig) => uuids.push(MigDevice {
                slot,
                uuid: mig.uuid()?,
            }),
            // Slots need not be filled in order.
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(uuids)
}

fn as_u64(v: &SampleValue) -> Option<u64> {
    match *v {
        SampleValue::U32(n) => Some(u64::from(n)),
        SampleValue::U64(n) => Some(n),
        SampleValue::I64(n) => u64::try_from(n).ok(),
        SampleValue::F64(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::contract::{AnnotationValue, GpuReport};
    use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

    use super::*;

    fn healthy() -> DeviceReading {
        DeviceReading {
            index: 0,
            uuid: "GPU-0a1b2c3d-0000-4000-8000-000000000000".into(),
            pci_bus_id: "00000000:E1:00.0".into(),
            recovery_action: Some(0),
            remapped_rows: Some(RemappedRows {
                pending: false,
                failure: false,
            }),
            retired_pages_pending: Some(false),
            uncorrected_ecc_volatile: Some(0),
            ..Default::default()
        }
    }

    #[test]
    fn the_recovery_action_decides_first() {
        for (value, expected) in [
            (0, GpuHealth::Healthy),
            (1, GpuHealth::ResetRequired),
            (2, GpuHealth::RebootRequired),
            (3, GpuHealth::ResetRequired),
            (4, GpuHealth::ResetRequired),
            // Newer values than we know: the strongest known action.
            (7, GpuHealth::RebootRequired),
        ] {
            let r = DeviceReading {
                recovery_action: Some(value),
                ..healthy()
            };
            assert_eq!(health(&r), expected, "recovery action {value}");
        }
    }

    #[test]
    fn memory_signals() {
        let failed = DeviceReading {
            remapped_rows: Some(RemappedRows {
                pending: true,
                failure: true,
            }),
            ..healthy()
        };
        assert_eq!(health(&failed), GpuHealth::ResetRequired);
        let pending = DeviceReading {
            remapped_rows: Some(RemappedRows {
                pending: true,
                failure: false,
            }),
            ..healthy()
        };
        assert_eq!(health(&pending), GpuHealth::Degraded);
        let ecc = DeviceReading {
            uncorrected_ecc_volatile: Some(2),
            ..healthy()
        };
        assert_eq!(health(&ecc), GpuHealth::Degraded);
        let lost = DeviceReading {
            lost: Some("GPU is lost".into()),
            ..healthy()
        };
        assert_eq!(health(&lost), GpuHealth::Lost);
        // What a GPU cannot tell is not held against it.
        let unsupported = DeviceReading {
            recovery_action: None,
            remapped_rows: None,
            retired_pages_pending: None,
            uncorrected_ecc_volatile: None,
            unreadable: vec!["remapped rows pending (field 144): NotSupported".into()],
            ..healthy()
        };
        assert_eq!(health(&unsupported), GpuHealth::Healthy);
    }

    /// Read on an H200 with `--once --readings` (see `docs/device/h200-nvml/`).
    const RECORDED_H200: &str = include_str!("../../../docs/device/h200-nvml/readings.json");

    #[test]
    fn a_recorded_h200_is_healthy_and_its_report_keeps_the_contract() {
        let readings: Vec<DeviceReading> = serde_json::from_str(RECORDED_H200).expect("fixture");
        assert_eq!(readings.len(), 1);
        let r = &readings[0];
        // Hopper has no page retirement: unreadable, not held against it.
        assert_eq!(r.retired_pages_pending, None);
        assert!(r.unreadable.iter().any(|u| u.starts_with("retired pages")));
        assert_eq!(health(r), GpuHealth::Healthy);
        let report = GpuReport {
            version: GpuReport::VERSION,
            observed_at: Time(Timestamp::UNIX_EPOCH),
            source: Some("gpuhealth-agent/nvml".into()),
            capabilities: None,
            unreadable: None,
            gpus: readings.iter().map(entry).collect(),
        };
        report.check().expect("a report the operator accepts");
        // The same GPU in trouble: the driver asks for a reset.
        let broken = DeviceReading {
            recovery_action: Some(1),
            ..r.clone()
        };
        assert_eq!(entry(&broken).health, GpuHealth::ResetRequired);
    }

    #[test]
    fn without_a_driver_the_error_says_what_is_missing() {
        let library = "/nonexistent/libnvidia-ml.so.1";
        let e = open(OsStr::new(library)).expect_err("no such library");
        assert!(e.to_string().contains(library), "{e}");
        assert!(
            e.to_string().contains("is the NVIDIA driver installed"),
            "{e}"
        );
    }

    #[test]
    fn a_gpu_is_back_only_when_the_driver_asks_for_nothing_more() {
        assert_eq!(not_recovered(&healthy()), None);
        let still = DeviceReading {
            recovery_action: Some(1),
            ..healthy()
        };
        assert!(not_recovered(&still).is_some_and(|w| w.contains("recovery action")));
        let pending = DeviceReading {
            remapped_rows: Some(RemappedRows {
                pending: true,
                failure: false,
            }),
            ..healthy()
        };
        assert!(not_recovered(&pending).is_some_and(|w| w.contains("pending")));
        // What the GPU cannot tell is not held against it.
        let unknown = DeviceReading {
            recovery_action: None,
            remapped_rows: None,
            ..healthy()
        };
        assert_eq!(not_recovered(&unknown), None);
    }
}
