//! From what a node shows to what it needs: evaluates a policy's detection
//! rules against the node's conditions and GPU report.

use gpuhealth_api::{
    GpuHealth, RecoveryAction,
    contract::{ContractError, GpuEntry, GpuReport, XidEvent},
    node_health::{ReportProblem, ReportProblemKind},
    policy::{ConditionStatus, Detection},
    types::SignalAction,
    vocabulary::Reason,
};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::{
    fence::DeviceView,
    gangs::GangWindow,
    xid::{self, XidClass},
};

mod app_faults;
mod devices;
mod silence;

pub use app_faults::AppFaultLoop;
pub use devices::{HeldDevice, UnhealthyDevice};

/// A node condition as observed.
#[derive(Clone, Debug, PartialEq)]
pub struct ObservedCondition {
    pub type_: String,
    pub status: String,
    pub last_transition: Timestamp,
}

/// One reason the node needs an action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signal {
    pub action: RecoveryAction,
    pub reason: Reason,
    pub message: String,
    /// The GPU concerned, if the signal names one.
    pub gpu: Option<String>,
    /// The Xid it comes from, if it does.
    pub xid: Option<XidEvent>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Diagnosis {
    /// Signals that hold now, strongest first.
    pub signals: Vec<Signal>,
    /// When the earliest signal still inside its `for` window becomes firm.
    pub pending_until: Option<Timestamp>,
    /// Why the GPU report could not be read, if it could not.
    pub report_error: Option<ContractError>,
    /// Xids seen that the table does not know: reported, never acted on.
    pub unknown_xids: Vec<u32>,
    /// Xids NVML did not confirm (`XidEvent::uncorroborated`): the GPU in
    /// words and the Xid; findings, never acted on.
    pub uncorroborated: Vec<(String, XidEvent)>,
    /// Pods whose own code faulted a GPU again and again: findings on the
    /// pods, nothing done to the GPU.
    pub app_fault_loops: Vec<AppFaultLoop>,
    /// Why the report cannot be trusted now (stale, its writer cannot read
    /// the GPUs, or there is none), if it cannot.
    pub report_problem: Option<ReportProblem>,
    /// When a report fresh now goes stale, or a node without one is said
    /// to have none: when to look again.
    pub stale_at: Option<Timestamp>,
}

impl Diagnosis {
    /// The strongest action any signal asks for.
    pub fn required(&self) -> Option<RecoveryAction> {
        self.signals.iter().map(|s| s.action).max()
    }

    /// The GPUs named by signals, for a reset; empty when a signal names no
    /// GPU (then every GPU of the node is concerned).
    pub fn gpus(&self) -> Vec<String> {
        if self.signals.iter().any(|s| s.gpu.is_none()) {
            return Vec::new();
        }
        let mut gpus: Vec<String> = self.signals.iter().filter_map(|s| s.gpu.clone()).collect();
        gpus.sort();
        gpus.dedup();
        gpus
    }

    /// The strongest signal, for the status reason.
    pub fn headline(&self) -> Option<&Signal> {
        self.signals.first()
    }

    pub fn is_clear(&self) -> bool {
        self.signals.is_empty() && self.pending_until.is_none()
    }
}

/// What the node shows, for diagnosis.
pub struct Evidence<'a> {
    pub conditions: &'a [ObservedCondition],
    pub report: Option<&'a Result<GpuReport, ContractError>>,
    /// When the report was last refreshed, by the operator's clock (else
    /// its own `observedAt` is taken).
    pub report_refreshed_at: Option<Timestamp>,
    /// With no report: since when one has been awaited (see
    /// `NodeView::report_awaited_since`); None, none is.
    pub report_awaited_since: Option<Timestamp>,
    /// With no report: the stored status already says there is none, so
    /// its grace is over whatever `report_awaited_since` says (a restarted
    /// operator awaits it afresh).
    pub report_missing_before: bool,
    /// Xids before this instant are history (a reset or reboot since has
    /// answered them); so are device taints added before it.
    pub xids_since: Option<Timestamp>,
    /// The node's DRA devices, with the taints their driver put on them.
    pub devices: &'a [DeviceView],
    /// GPUs the kubelet reports unhealthy in the status of the pods that
    /// hold them.
    pub unhealthy: &'a [UnhealthyDevice],
    /// A gang that ran on the node and is down now for another node's
    /// incident: a repair that waits for a reset is due in its window.
    pub gang_window: Option<&'a GangWindow>,
}

pub fn diagnose(now: Timestamp, detection: &Detection, evidence: &Evidence<'_>) -> Diagnosis {
    let mut d = Diagnosis::default();
    for rule in &detection.node_conditions {
        // Without writers anyone who may patch a Node's status could have
        // written it; a reserved type is the node lifecycle's or the
        // agent's (`honour` says so in the policy's Ready condition).
        if !rule.acted_on() {
            continue;
        }
        let Some(action) = rule.action.recovery_action() else {
            continue;
        };
        let wanted = match rule.status {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        };
        let Some(c) = evidence
            .conditions
            .iter()
            .find(|c| c.type_ == rule.type_ && c.status == wanted)
        else {
            continue;
        };
        let firm_at = after(c.last_transition, rule.for_.as_std());
        if firm_at <= now {
            d.signals.push(Signal {
                action,
                reason: Reason::NodeCondition,
                message: format!(
                    "node condition {}={} since {}",
                    c.type_, c.status, c.last_transition
                ),
                gpu: None,
                xid: None,
            });
        } else {
            d.pending_until = Some(d.pending_until.map_or(firm_at, |p| p.min(firm_at)));
        }
    }
    if detection.gpu_report.enabled {
        match evidence.report {
            Some(Ok(report)) => {
                for gpu in &report.gpus {
                    gpu_signals(now, detection, gpu, evidence.xids_since, &mut d);
                    if let Some(window) = evidence.gang_window {
                        repair_with_gang(gpu, window, &mut d);
                    }
                }
                let refreshed = evidence.report_refreshed_at.unwrap_or(report.observed_at.0);
                report_problem(now, detection, report, refreshed, &mut d);
            }
            Some(Err(e)) => d.report_error = Some(e.clone()),
            None => silence::no_report(now, detection, evidence, &mut d),
        }
    }
    devices::device_taint_signals(detection, evidence, &mut d);
    devices::pod_device_health_signals(detection, evidence, &mut d);
    // Strongest first, an Xid first among equals (its code and text say
    // why); stable, so the rest keep the order found.
    d.signals
        .sort_by_key(|s| (std::cmp::Reverse(s.action), s.xid.is_none()));
    d
}

/// A serving GPU whose repair waits for its next reset (a pending row
/// remap) gets it now, while `window`'s gang is down anyway, instead of
/// stopping the gang a second time later.
fn repair_with_gang(gpu: &GpuEntry, window: &GangWindow, d: &mut Diagnosis) {
    let pending = gpu
        .remapped_rows
        .as_ref()
        .is_some_and(|r| r.pending && !r.failure);
    if !pending || !gpu.health.is_serving() {
        return;
    }
    d.signals.push(Signal {
        action: RecoveryAction::GpuReset,
        reason: Reason::RepairedWithGang,
        message: format!(
            "GPU {} ({}) has a row remap pending until its next reset: repaired now, while {} is down for incident {} of node {}",
            gpu.index, gpu.uuid, window.gang, window.incident, window.node
        ),
        gpu: Some(gpu.uuid.clone()),
        xid: None,
    });
}

/// A report whose writer cannot read the GPUs, or that has not been
/// refreshed within `staleAfter`, is said so.
fn report_problem(
    now: Timestamp,
    detection: &Detection,
    report: &GpuReport,
    refreshed: Timestamp,
    d: &mut Diagnosis,
) {
    let stale_after = detection.gpu_report.stale_after;
    let stale_at = after(refreshed, stale_after.as_std());
    if let Some(why) = &report.unreadable {
        d.report_problem = Some(ReportProblem {
            kind: ReportProblemKind::Unreadable,
            message: format!(
                "the report's writer ({}) cannot read the GPUs: {why}",
                report.source.as_deref().unwrap_or("unnamed")
            ),
        });
    } else if stale_at <= now {
        d.report_problem = Some(ReportProblem {
            kind: ReportProblemKind::Stale,
            message: format!(
                "the GPU report was last refreshed at {refreshed}, longer ago than detection.gpuReport.staleAfter ({stale_after}): is its writer ({}) running?",
                report.source.as_deref().unwrap_or("unnamed")
            ),
        });
    } else {
        d.stale_at = Some(stale_at);
    }
}

fn gpu_signals(
    now: Timestamp,
    detection: &Detection,
    gpu: &GpuEntry,
    since: Option<Timestamp>,
    d: &mut Diagnosis,
) {
    let name = || format!("GPU {} ({}, {})", gpu.index, gpu.uuid, gpu.pci_bus_id);
    let mut push =
        |action: SignalAction, reason: Reason, message: String, xid: Option<&XidEvent>| {
            if let Some(action) = action.recovery_action() {
                d.signals.push(Signal {
                    action,
                    reason,
                    message,
                    gpu: Some(gpu.uuid.clone()),
                    xid: xid.cloned(),
                });
            }
        };
    if detection.gpu_report.unhealthy_states.contains(&gpu.health) {
        let (action, reason) = match gpu.health {
            GpuHealth::ResetRequired => (SignalAction::GpuReset, Reason::GpuResetRequired),
            GpuHealth::RebootRequired => (SignalAction::NodeReboot, Reason::GpuRebootRequired),
            GpuHealth::Lost => (SignalAction::NodeReboot, Reason::GpuLost),
            // A policy may count Degraded as unhealthy: a reset is the mildest answer.
            GpuHealth::Degraded => (SignalAction::GpuReset, Reason::GpuDegraded),
            GpuHealth::Healthy => (SignalAction::Ignore, Reason::Unhealthy),
        };
        push(
            action,
            reason,
            format!("{} reports {:?}", name(), gpu.health),
            None,
        );
    }
    if let Some(value) = gpu.recovery_action {
        push(
            xid::recovery_action(value),
            Reason::RecoveryAction,
            format!("{} recovery action {value:#x}", name()),
            None,
        );
    }
    let recent = gpu.xids.iter().filter(|x| since.is_none_or(|s| x.at.0 > s));
    let mut app_faults = Vec::new();
    for x in recent {
        if x.uncorroborated {
            d.uncorroborated.push((name(), x.clone()));
            continue;
        }
        match xid::class(x.code, &detection.xid_overrides) {
            XidClass::Needs(action) => push(
                action,
                Reason::Xid,
                format!("Xid {} on {}: {}", x.code, name(), x.text),
                Some(x),
            ),
            XidClass::RecoveryActionChanged => {
                if let Some(value) = xid::recovery_action_in_text(&x.text) {
                    push(
                        xid::recovery_action(value),
                        Reason::Xid,
                        format!("Xid 154 on {}: {}", name(), x.text),
                        Some(x),
                    );
                }
            }
            XidClass::AppFault => {
                if now.duration_since(x.at.0)
                    <= SignedDuration::from_secs(xid::APP_FAULT_WINDOW_SECS)
                {
                    app_faults.push(x);
                }
            }
            XidClass::Informational => {}
            XidClass::Unknown => d.unknown_xids.push(x.code),
        }
    }
    let verdict = app_faults::judge(gpu, &name(), &app_faults);
    if let Some(message) = verdict.reset {
        push(
            SignalAction::GpuReset,
            Reason::RepeatedAppXids,
            message,
            None,
        );
    }
    d.app_fault_loops.extend(verdict.loops);
}

/// `t + d`, saturating rather than overflowing.
pub fn after(t: Timestamp, d: std::time::Duration) -> Timestamp {
    t.saturating_add(d).unwrap_or(Timestamp::MAX)
}

#[cfg(test)]
mod tests;
