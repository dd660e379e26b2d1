//! What an incident takes out of service (the node, or its bad GPUs), and
//! keeping gpuhealth's `DeviceTaintRule`s to what the status records.
//!
//! The status is the intent: a handler records the quarantine, and
//! `keep_fences`, at the end of every step under `Enforce`, asks for the
//! rules it names that are not up and the removal of every rule of ours it
//! does not name. So a rule written and not yet recorded, or deleted and
//! not yet recorded as gone, is put right by the next step whenever the
//! operator stopped.

use std::time::Duration;

use gpuhealth_api::{
    RecoveryAction,
    node_health::PlannedQuarantine,
    policy::Mode,
    quarantine::{Fenced, GpuFence, QuarantineScope, QuarantineStatus},
    vocabulary::{DeviceId, FindingKind, QuarantineWhy},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

use crate::{
    diagnosis::after,
    fence::{Ask, BadGpu, Choice, choose, plugin_fences},
    happening::Happening,
};

use crate::machine::{Action, FENCE_SETTLE, POLL, core::Stepper};

impl Stepper<'_> {
    /// How much of the node an incident about `gpus` that starts with
    /// `step` (None: a maintenance) would take out of service now.
    pub(super) fn choose_quarantine(
        &self,
        incident: &str,
        gpus: &[String],
        step: Option<RecoveryAction>,
    ) -> Choice {
        let bad = self.bad_gpus(gpus);
        let drain_scope = step.map_or(self.spec().drain.scope, |s| self.drain_scope(s));
        let holders_unknown = self.holders_unknown(gpus);
        choose(&Ask {
            policy: &self.spec().quarantine,
            incident,
            gpus: &bad,
            step,
            drain_scope,
            holders_unknown: holders_unknown.as_deref(),
            dra: self.input.node.dra.as_ref(),
            plugin: self.input.node.gpu_resource,
        })
    }

    /// `gpus` as the node's report shows them.
    fn bad_gpus(&self, gpus: &[String]) -> Vec<BadGpu> {
        let entry = |uuid: &str| match &self.input.node.report {
            Some(Ok(r)) => r.gpus.iter().find(|g| g.uuid == uuid),
            _ => None,
        };
        gpus.iter()
            .map(|uuid| BadGpu {
                uuid: uuid.clone(),
                index: entry(uuid).map(|g| g.index),
                offered: entry(uuid).and_then(|g| g.offered),
            })
            .collect()
    }

    /// The first rung an incident on `required` would take: the first at
    /// least as strong, less those the agent cannot carry out.
    pub(super) fn first_step(&self, required: RecoveryAction) -> Option<RecoveryAction> {
        let ladder = &self.spec().escalation;
        let from = ladder
            .iter()
            .position(|r| r.action >= required)
            .unwrap_or(ladder.len().saturating_sub(1));
        ladder
            .iter()
            .skip(from)
            .map(|r| r.action)
            .find(|a| self.unavailable(*a).is_none())
    }

    /// Records `choice` as the open incident's quarantine. The GPUs' rules
    /// are put up by `keep_fences`; the cordon by the caller.
    pub(super) fn record_quarantine(&mut self, incident: &str, choice: Choice) {
        // A policy that asked for per-GPU quarantine by name hears why it
        // got the node.
        if choice.scope == Fenced::Node && self.spec().quarantine.scope == QuarantineScope::Gpu {
            self.finding(
                FindingKind::NodeQuarantinedInstead,
                None,
                format!(
                    "the policy asks for per-GPU quarantine; the node is cordoned instead: {}",
                    choice.message
                ),
            );
        }
        self.status.quarantine = Some(QuarantineStatus {
            incident: incident.to_owned(),
            scope: choice.scope,
            why: choice.why,
            message: choice.message,
            gpus: choice.gpus,
            since: Time(self.now()),
            lifted_at: None,
        });
    }

    /// What a `DryRun` policy would take out of service for a step.
    pub(super) fn planned_quarantine(&self, step: Option<RecoveryAction>) -> PlannedQuarantine {
        let gpus = self.diagnosis.gpus();
        let choice = self.choose_quarantine("dry-run", &gpus, step);
        PlannedQuarantine {
            scope: choice.scope,
            why: choice.why,
            message: choice.message,
        }
    }

    /// Whether the open incident's quarantine holds: for the node, the
    /// cordon (asked for again if it has not landed); for its GPUs, every
    /// rule it names seen up. False until it does.
    pub(super) fn fenced(&mut self) -> bool {
        let Some(q) = self.status.quarantine.as_ref().filter(|q| q.per_gpu()) else {
            return self.cordoned();
        };
        let up = self.rules_up();
        if q.rules().all(|r| up.iter().any(|u| u == r)) {
            return true;
        }
        self.wait(POLL);
        false
    }

    /// How long the incident's `DeviceTaintRule`s must still stand before
    /// the step they fence is asked for ([`FENCE_SETTLE`]), and since
    /// when the newest has stood; none once they have settled. A rule
    /// written again (someone deleted it) settles again.
    pub(super) fn fence_settling(&self) -> Option<(Duration, Timestamp)> {
        let q = self.status.quarantine.as_ref().filter(|q| q.per_gpu())?;
        let ours: Vec<&str> = q.rules().collect();
        let newest = self
            .input
            .node
            .dra
            .as_ref()?
            .rules
            .iter()
            .filter(|r| ours.contains(&r.name.as_str()))
            .filter_map(|r| r.created)
            .max()?;
        let settled = after(newest, FENCE_SETTLE);
        let left = settled.duration_since(self.now()).try_into().ok()?;
        (left > Duration::ZERO).then_some((left, newest))
    }

    /// A per-GPU quarantine that a later step widened to the node: that
    /// step waits for the cordon.
    pub(super) fn widened_and_not_cordoned(&mut self) -> bool {
        let widened = self.status.quarantine.as_ref().is_some_and(|q| {
            q.scope == Fenced::Node && !q.gpus.is_empty() && q.lifted_at.is_none()
        });
        widened && !self.cordoned()
    }

    pub(super) fn rules_up(&self) -> Vec<String> {
        self.input
            .node
            .dra
            .as_ref()
            .map(|d| d.rules.iter().map(|r| r.name.clone()).collect())
            .unwrap_or_default()
    }

    /// Takes the whole node out of service for the rest of the incident,
    /// the GPUs' fences staying up until it ends.
    pub(super) fn widen_to_node(&mut self, why: QuarantineWhy, message: String) {
        let Some(q) = self.status.quarantine.clone().filter(|q| q.per_gpu()) else {
            return;
        };
        self.fence_ended(&q);
        let incident = q.incident.clone();
        if let Some(q) = self.status.quarantine.as_mut() {
            q.scope = Fenced::Node;
            q.why = why;
            q.message = message;
        }
        if !self.input.node.unschedulable {
            self.actions.push(Action::Cordon { incident });
        }
    }

    /// Says how long `q` kept its GPUs from new work while the rest served.
    fn fence_ended(&mut self, q: &QuarantineStatus) {
        let gpus = match &self.input.node.report {
            Some(Ok(r)) => r.gpus.len(),
            _ => q.gpus.len(),
        };
        let fenced = q.gpus.len();
        let lasted = self
            .now()
            .duration_since(q.since.0)
            .try_into()
            .unwrap_or(Duration::ZERO);
        self.tell(Happening::GpuFenceEnded {
            fenced: fenced as u32,
            serving: gpus.saturating_sub(fenced) as u32,
            lasted,
        });
    }

    /// The incident is over: its fences come down. The record stays until
    /// its rules are seen gone.
    pub(super) fn lift_quarantine(&mut self) {
        let Some(q) = self.status.quarantine.clone() else {
            return;
        };
        if q.per_gpu() {
            self.fence_ended(&q);
        }
        let now = Time(self.now());
        if q.rules().next().is_none() {
            self.status.quarantine = None;
        } else if let Some(q) = self.status.quarantine.as_mut() {
            q.lifted_at = Some(now);
        }
    }

    /// Every step under `Enforce`: puts up the rules the open quarantine
    /// names and that are not up, takes down every rule of ours it does not
    /// name, forgets a lifted quarantine once its rules are gone, and widens
    /// to the node a per-GPU fence that no longer holds.
    pub(super) fn keep_fences(&mut self) {
        if self.spec().mode != Mode::Enforce {
            return;
        }
        self.fence_still_holds();
        let wanted: Vec<(String, DeviceId)> = match &self.status.quarantine {
            Some(q)
                if q.lifted_at.is_none()
                    && self.status.incident.as_deref() == Some(&q.incident) =>
            {
                q.gpus
                    .iter()
                    .filter_map(|g| Some((g.rule.clone()?, g.device.clone()?)))
                    .collect()
            }
            _ => Vec::new(),
        };
        let up = self.rules_up();
        for rule in &up {
            if !wanted.iter().any(|(w, _)| w == rule) {
                self.actions
                    .push(Action::UntaintDevice { rule: rule.clone() });
            }
        }
        let incident = self.status.incident.clone().unwrap_or_default();
        for (rule, device) in wanted {
            if !up.contains(&rule) {
                self.actions.push(Action::TaintDevice {
                    rule,
                    device,
                    incident: incident.clone(),
                });
            }
        }
        let forget = self.status.quarantine.as_ref().is_some_and(|q| {
            let open = self.status.incident.as_deref() == Some(q.incident.as_str());
            (q.lifted_at.is_some() || !open) && q.rules().all(|r| !up.iter().any(|u| u == r))
        });
        if forget {
            self.status.quarantine = None;
        }
    }

    /// A per-GPU fence that stops holding while its GPU is still bad widens
    /// to the node: a bad GPU is never left schedulable.
    fn fence_still_holds(&mut self) {
        let Some(q) = self.status.quarantine.clone().filter(|q| q.per_gpu()) else {
            return;
        };
        if self.status.incident.as_deref() != Some(q.incident.as_str()) {
            return;
        }
        let bad = self.diagnosis.gpus();
        let still_bad = q.gpus.iter().any(|g| bad.contains(&g.uuid));
        let by_plugin = q.gpus.iter().any(|g| g.fence == GpuFence::DevicePlugin);
        let by_rule = q.gpus.iter().any(|g| g.fence == GpuFence::DeviceTaintRule);
        if by_rule && !self.input.node.dra.as_ref().is_some_and(|d| d.can_taint) {
            self.widen_to_node(
                QuarantineWhy::NoDeviceFence,
                "the cluster no longer serves DeviceTaintRules".into(),
            );
        } else if by_plugin
            && still_bad
            && !plugin_fences(self.input.node.gpu_resource, &self.bad_gpus(&bad))
        {
            {
                let offered = self.input.node.gpu_resource.map_or_else(
                    || "none".to_owned(),
                    |c| format!("{} of {}", c.allocatable, c.capacity),
                );
                self.widen_to_node(
                    QuarantineWhy::DevicePluginOffersBadGpu,
                    format!(
                        "the device plugin offers a bad GPU again ({offered} {} allocatable, {} bad)",
                        self.spec().quarantine.device_plugin_resource,
                        bad.len()
                    ),
                );
            }
        }
    }
}
