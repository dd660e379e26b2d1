//! How much a policy may disrupt at once: `maxConcurrent` nodes in a
//! disruptive phase, and the `maxUnhealthy` circuit breaker.

use std::collections::HashSet;

use gpuhealth_api::{
    gang::GangMode,
    node_health::{GpuNodeHealthStatus, Phase},
    policy::GpuHealthPolicySpec,
    vocabulary::Reason,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// Whether a phase holds a node out of service on gpuhealth's account (what
/// `maxConcurrent` counts).
pub fn is_disruptive(phase: Phase) -> bool {
    matches!(
        phase,
        Phase::Quarantined
            | Phase::Draining
            | Phase::Remediating
            | Phase::AwaitingMaintenance
            | Phase::Verifying
    )
}

/// Whether a node counts against the circuit breaker: a signal not yet
/// firm, or a scheduled maintenance, says nothing about the fleet's health.
pub fn unhealthy(s: &GpuNodeHealthStatus) -> bool {
    s.phase != Phase::Healthy
        && s.reason.is_none_or(Reason::counts_as_unhealthy)
        && s.maintenance.is_none()
}

/// The nodes of the gangs a draining node is taking down whole: from the
/// notice until the node's drain is over, their work is stopped on
/// gpuhealth's account as surely as the node's own. The gang's own start is
/// not held for them: one bad GPU has stopped it already.
fn gang_nodes(status: &GpuNodeHealthStatus) -> impl Iterator<Item = &str> {
    let draining = status.phase == Phase::Draining;
    status
        .history
        .first()
        .filter(|i| draining && i.ended_at.is_none())
        .into_iter()
        .flat_map(|i| &i.gangs)
        .filter(|g| g.mode == GangMode::Whole && g.evict_at.is_some())
        .flat_map(|g| g.nodes.iter().map(String::as_str))
}

/// A policy's nodes as its budget counts them: the one place they are
/// counted, for a node's decision and for the policy's status alike.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fleet<'a> {
    /// Nodes out of service on gpuhealth's account.
    pub disruptive: HashSet<&'a str>,
    /// Nodes handed over to a person (`Failed`): theirs now, whatever
    /// fence of gpuhealth's they still carry.
    pub handed_over: HashSet<&'a str>,
    /// Nodes counted by the circuit breaker.
    pub unhealthy: usize,
}

impl<'a> Fleet<'a> {
    /// Counts `statuses`: every node of the policy, less any the caller
    /// leaves out (the node deciding counts itself apart).
    pub fn count(statuses: impl IntoIterator<Item = (&'a str, &'a GpuNodeHealthStatus)>) -> Self {
        let mut fleet = Fleet::default();
        for (name, status) in statuses {
            if is_disruptive(status.phase) {
                fleet.disruptive.insert(name);
                fleet.disruptive.extend(gang_nodes(status));
            }
            if status.phase == Phase::Failed {
                fleet.handed_over.insert(name);
            }
            fleet.unhealthy += usize::from(unhealthy(status));
        }
        fleet
    }

    /// The budget of a node about to decide, counted apart from `self`:
    /// `managed` nodes in all; `still_fenced` (nodes carrying gpuhealth's
    /// cordon or device rules) counted as disrupted until the fence is
    /// gone, unless handed over; and `disrupted_by_others` (nodes other
    /// tools are disrupting) taking capacity too unless gpuhealth counts
    /// them already. A recovered node's status says `Healthy` before its
    /// fence is lifted (the intent first): without the fence counted, the
    /// next node would start in that gap, one more than `maxConcurrent`.
    /// The node counts itself as unhealthy: it asks only when it wants to
    /// start, the one time the engine consults the breaker.
    pub fn budget_for_one_more(
        &self,
        spec: &GpuHealthPolicySpec,
        managed: usize,
        still_fenced: &[String],
        disrupted_by_others: &[String],
    ) -> Budget {
        let lifting = still_fenced
            .iter()
            .map(String::as_str)
            .filter(|n| !self.disruptive.contains(n) && !self.handed_over.contains(n))
            .collect::<HashSet<_>>();
        let by_others = disrupted_by_others
            .iter()
            .map(String::as_str)
            .filter(|n| !self.disruptive.contains(n) && !lifting.contains(n))
            .count();
        let disruptive = self.disruptive.len() + lifting.len();
        Budget::new(spec, managed, disruptive, self.unhealthy + 1).with_others(by_others)
    }

    /// The budget as the policy's status shows it: whether the breaker is open.
    pub fn budget(&self, spec: &GpuHealthPolicySpec, managed: usize) -> Budget {
        Budget::new(spec, managed, self.disruptive.len(), self.unhealthy)
    }
}

/// A policy's budget, resolved against its fleet right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Nodes that may be in a disruptive phase at once.
    pub max_concurrent: usize,
    /// Unhealthy nodes tolerated before the breaker opens.
    pub max_unhealthy: usize,
    /// Other nodes of the policy in a disruptive phase now.
    pub disruptive_elsewhere: usize,
    /// Nodes of the policy with a firm signal now, this one included.
    pub unhealthy: usize,
    /// Other nodes of the policy that other tools are disrupting now (and
    /// gpuhealth is not): they take capacity out just the same.
    pub disrupted_by_others: usize,
    /// Across every policy, the nodes in a disruptive phase now (this one
    /// apart) and the most the cluster's guardrail allows; None: unbounded.
    pub across_policies: Option<(usize, usize)>,
    /// The node is counted as disrupted already (a gang it ran is being
    /// taken down whole): starting it takes nothing more out of service.
    pub already_disrupted: bool,
}

/// Why a remediation may not start now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// `maxConcurrent` nodes are already being remediated.
    Concurrency,
    /// More nodes are unhealthy than `maxUnhealthy` allows.
    CircuitOpen,
    /// As many nodes as the cluster's guardrail allows are disrupted, across
    /// all policies.
    Guardrail,
}

impl Hold {
    pub fn reason(self) -> Reason {
        match self {
            Hold::Concurrency | Hold::Guardrail => Reason::WaitingForBudget,
            Hold::CircuitOpen => Reason::CircuitOpen,
        }
    }
}

impl Budget {
    pub fn new(
        spec: &GpuHealthPolicySpec,
        nodes: usize,
        disruptive_elsewhere: usize,
        unhealthy: usize,
    ) -> Self {
        Budget {
            // A percentage rounds down but never below one node: a policy
            // that can never act is not what anyone means by 10%.
            max_concurrent: resolve(&spec.max_concurrent, nodes, Rounding::Down).max(1),
            // Rounds up, so that 25% of a three-node pool tolerates one sick node.
            max_unhealthy: resolve(&spec.max_unhealthy, nodes, Rounding::Up),
            disruptive_elsewhere,
            unhealthy,
            disrupted_by_others: 0,
            across_policies: None,
            already_disrupted: false,
        }
    }

    /// The same budget for a start that only brings a repair forward (one
    /// that waits for a reset, done while a gang is down anyway): no sign
    /// of the fleet's health, so the node does not count itself unhealthy.
    pub fn brought_forward(self) -> Self {
        Budget {
            unhealthy: self.unhealthy.saturating_sub(1),
            ..self
        }
    }

    /// The same budget for a node `fleet` counts as disrupted already, if
    /// it does (the circuit breaker still holds it).
    pub fn for_node(self, fleet: &Fleet<'_>, node: &str) -> Self {
        Budget {
            already_disrupted: fleet.disruptive.contains(node),
            ..self
        }
    }

    /// The same budget under the cluster's bound across policies:
    /// `disrupted` nodes of every policy disrupted now, at most `max`.
    pub fn across_policies(self, disrupted: usize, max: usize) -> Self {
        Budget {
            across_policies: Some((disrupted, max)),
            ..self
        }
    }

    /// The same budget with `n` other nodes disrupted by other tools.
    pub fn with_others(self, n: usize) -> Self {
        Budget {
            disrupted_by_others: n,
            ..self
        }
    }

    pub fn circuit_open(&self) -> bool {
        self.unhealthy > self.max_unhealthy
    }

    /// Whether a new remediation may start on this node now.
    pub fn may_start(&self) -> Result<(), Hold> {
        if self.circuit_open() {
            Err(Hold::CircuitOpen)
        } else if self.already_disrupted {
            Ok(())
        } else if self.disruptive_elsewhere + self.disrupted_by_others >= self.max_concurrent {
            Err(Hold::Concurrency)
        } else if self
            .across_policies
            .is_some_and(|(disrupted, max)| disrupted >= max)
        {
            Err(Hold::Guardrail)
        } else {
            Ok(())
        }
    }
}

/// `value` of `total`, a percentage rounding down.
pub fn resolve_down(value: &IntOrString, total: usize) -> usize {
    resolve(value, total, Rounding::Down)
}

#[derive(Clone, Copy)]
enum Rounding {
    Down,
    Up,
}

/// A count, or a percentage of `total`. The API server has validated the
/// format; anything else resolves to 0, which holds remediation back rather
/// than allowing it.
fn resolve(value: &IntOrString, total: usize, rounding: Rounding) -> usize {
    match value {
        IntOrString::Int(n) => usize::try_from(*n).unwrap_or(0),
        IntOrString::String(s) => {
            let Some(pct) = s.strip_suffix('%').and_then(|p| p.parse::<usize>().ok()) else {
                return 0;
            };
            let scaled = total.saturating_mul(pct.min(100));
            match rounding {
                Rounding::Down => scaled / 100,
                Rounding::Up => scaled.div_ceil(100),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(max_concurrent: IntOrString, max_unhealthy: IntOrString) -> GpuHealthPolicySpec {
        let mut s = GpuHealthPolicySpec::for_selector(Default::default());
        s.max_concurrent = max_concurrent;
        s.max_unhealthy = max_unhealthy;
        s
    }

    #[test]
    fn defaults_on_ten_nodes() {
        let b = Budget::new(
            &GpuHealthPolicySpec::for_selector(Default::default()),
            10,
            0,
            1,
        );
        assert_eq!((b.max_concurrent, b.max_unhealthy), (1, 3));
        assert_eq!(b.may_start(), Ok(()));
        assert_eq!(
            Budget {
                disruptive_elsewhere: 1,
                ..b
            }
            .may_start(),
            Err(Hold::Concurrency)
        );
        assert_eq!(
            Budget { unhealthy: 4, ..b }.may_start(),
            Err(Hold::CircuitOpen)
        );
    }

    #[test]
    fn percentages() {
        let s = spec(
            IntOrString::String("10%".into()),
            IntOrString::String("25%".into()),
        );
        assert_eq!(
            Budget::new(&s, 3, 0, 0).max_concurrent,
            1,
            "never below one"
        );
        assert_eq!(Budget::new(&s, 3, 0, 0).max_unhealthy, 1, "rounds up");
        assert_eq!(Budget::new(&s, 100, 0, 0).max_concurrent, 10);
        assert_eq!(Budget::new(&s, 0, 0, 0).max_unhealthy, 0);
        let zero = spec(IntOrString::Int(1), IntOrString::String("0%".into()));
        assert_eq!(
            Budget::new(&zero, 10, 0, 1).may_start(),
            Err(Hold::CircuitOpen)
        );
    }

    #[test]
    fn malformed_values_hold_back() {
        let s = spec(
            IntOrString::String("lots".into()),
            IntOrString::String("x%".into()),
        );
        let b = Budget::new(&s, 10, 0, 1);
        assert_eq!(b.max_unhealthy, 0);
        assert_eq!(b.may_start(), Err(Hold::CircuitOpen));
    }
}
