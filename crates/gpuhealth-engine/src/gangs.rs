//! A gang's round in a drain: when a member holds a GPU the step acts on
//! and the policy says `Whole`, every member, wherever it runs, is told,
//! then all leave together, or none does.

use std::collections::BTreeSet;

use gpuhealth_api::{
    contract::DisruptionTolerance, gang::GangKey, policy::Drain, vocabulary::PodKey,
};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::drain::{BudgetView, PodView, never_evicted};

/// A pod of a gang, wherever it runs.
#[derive(Clone, Debug, PartialEq)]
pub struct GangMember {
    /// Its node; None while unscheduled.
    pub node: Option<String>,
    pub pod: PodView,
}

/// A gang as observed: its members cluster-wide and the budgets on them.
#[derive(Clone, Debug, PartialEq)]
pub struct GangView {
    pub key: GangKey,
    /// Every pod of the gang (finished ones included; the round skips them).
    pub members: Vec<GangMember>,
    /// The PodDisruptionBudgets covering any member: a budget covering the
    /// gang is read as the gang's, one disruption for the whole gang.
    pub budgets: Vec<BudgetView>,
}

impl GangView {
    /// Members that hold anything: not finished.
    pub fn live(&self) -> impl Iterator<Item = &GangMember> {
        self.members.iter().filter(|m| !m.pod.finished)
    }

    /// The nodes its live members run on.
    pub fn nodes(&self) -> BTreeSet<&str> {
        self.live().filter_map(|m| m.node.as_deref()).collect()
    }
}

/// A gang another node's incident is taking down whole now (told, not yet
/// back): its members on any node leave with it, and a node it ran on may
/// repair in the same window what would otherwise stop the gang again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GangWindow {
    pub gang: GangKey,
    /// The node and incident taking it down.
    pub node: String,
    pub incident: String,
    /// When its members were told they leave.
    pub evict_at: Timestamp,
    /// The nodes its members ran on.
    pub nodes: Vec<String>,
}

impl GangWindow {
    /// Whether this window leads over a round of `node`'s own that told
    /// the gang at `own` (None: not told): the earlier notice leads, the
    /// node's name breaks a tie, so that of two incidents taking the same
    /// gang down exactly one tells and deletes it.
    pub fn leads(&self, node: &str, own: Option<Timestamp>) -> bool {
        self.node != node && own.is_none_or(|at| (self.evict_at, self.node.as_str()) < (at, node))
    }
}

/// Where the gang's round stands, as recorded on the incident.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GangProgress {
    /// When its members were told they leave.
    pub evict_at: Option<Timestamp>,
    /// When they were deleted together.
    pub evicted_at: Option<Timestamp>,
}

/// What the gang's round does now.
#[derive(Clone, Debug, PartialEq)]
pub enum GangRound {
    /// A member may never be evicted, so none is.
    Blocked { member: PodKey, why: String },
    /// A member tolerates only finishing on its own (`wait`): the gang waits.
    WaitingFor(PodKey),
    /// Members are leaving: after gpuhealth deleted them, or on their own
    /// (its controller restarting it), which is never met with a second
    /// eviction.
    Leaving { on_its_own: bool },
    /// Tell `pods` (every member not yet told) that the gang leaves at `at`.
    Tell { at: Timestamp, pods: Vec<PodKey> },
    /// Told, and due, but a budget on the gang allows no disruption now.
    HeldByBudget(Vec<String>),
    /// Delete every member now, together.
    Evict { pods: Vec<PodKey> },
}

/// The notice a gang is given: the policy's, but at most half of the
/// drain's timeout, so that the gang has the rest to leave in.
pub fn notice(drain: &Drain) -> std::time::Duration {
    drain.gangs.notice.as_std().min(drain.timeout.as_std() / 2)
}

/// The gang's round at `now`, from what it has done so far.
pub fn round(
    gang: &GangView,
    done: GangProgress,
    drain: &Drain,
    never: &[String],
    now: Timestamp,
) -> GangRound {
    if done.evicted_at.is_some() {
        // A delete that failed is tried again, for the members told; a
        // pod of the restarted gang was never told and is left alone.
        let again: Vec<PodKey> = gang
            .live()
            .filter(|m| {
                !m.pod.terminating && m.pod.evict_at.is_some() && m.pod.evict_at == done.evict_at
            })
            .map(|m| m.pod.key())
            .collect();
        return match again.is_empty() {
            true => GangRound::Leaving { on_its_own: false },
            false => GangRound::Evict { pods: again },
        };
    }
    if gang.live().any(|m| m.pod.terminating) {
        return GangRound::Leaving { on_its_own: true };
    }
    for m in gang.live() {
        if let Some(why) = never_evicted(drain, never, &m.pod) {
            return GangRound::Blocked {
                member: m.pod.key(),
                why,
            };
        }
    }
    if let Some(m) = gang
        .live()
        .find(|m| m.pod.tolerance == Ok(DisruptionTolerance::Wait))
    {
        return GangRound::WaitingFor(m.pod.key());
    }
    let notice = SignedDuration::try_from(notice(drain)).unwrap_or_default();
    let at = done
        .evict_at
        .unwrap_or_else(|| now.checked_add(notice).unwrap_or(now));
    if now < at {
        let pods = gang
            .live()
            .filter(|m| m.pod.evict_at != Some(at))
            .map(|m| m.pod.key())
            .collect();
        return GangRound::Tell { at, pods };
    }
    let holding: Vec<String> = gang
        .budgets
        .iter()
        .filter(|b| b.allowed <= 0)
        .map(|b| format!("{} allows no disruption now", b.name))
        .collect();
    if !holding.is_empty() {
        return GangRound::HeldByBudget(holding);
    }
    // Members that appeared during the notice leave with the rest.
    GangRound::Evict {
        pods: gang.live().map(|m| m.pod.key()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use gpuhealth_api::{gang::GangSource, policy::GpuHealthPolicySpec};

    use super::*;
    use crate::drain::GpuGate;

    fn member(name: &str, node: &str) -> GangMember {
        GangMember {
            node: Some(node.into()),
            pod: PodView {
                namespace: "ml".into(),
                name: name.into(),
                labels: BTreeMap::new(),
                daemon: false,
                mirror: false,
                terminating: false,
                finished: false,
                requests_gpu: true,
                gpus: Vec::new(),
                tolerance: Ok(DisruptionTolerance::Evict),
                workload: None,
                gpu_gate: GpuGate::NotOptedIn,
                gang: Some(key()),
                evict_at: None,
            },
        }
    }

    fn key() -> GangKey {
        GangKey {
            source: GangSource::JobSet,
            namespace: "ml".into(),
            name: "train".into(),
        }
    }

    fn gang(members: Vec<GangMember>) -> GangView {
        GangView {
            key: key(),
            members,
            budgets: Vec::new(),
        }
    }

    fn drain() -> Drain {
        GpuHealthPolicySpec::for_selector(Default::default()).drain
    }

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).expect("a time")
    }

    #[test]
    fn told_first_then_evicted_together_at_the_notice() {
        let mut g = gang(vec![member("r0", "a"), member("r1", "b")]);
        let d = drain();
        let GangRound::Tell { at, pods } = round(&g, GangProgress::default(), &d, &[], t(0)) else {
            panic!("told first")
        };
        assert_eq!(at, t(60));
        assert_eq!(pods.len(), 2);
        for m in &mut g.members {
            m.pod.evict_at = Some(at);
        }
        let told = GangProgress {
            evict_at: Some(at),
            evicted_at: None,
        };
        assert_eq!(
            round(&g, told, &d, &[], t(30)),
            GangRound::Tell { at, pods: vec![] },
            "all told: waits out the notice"
        );
        g.members.push(member("r2", "c"));
        assert_eq!(
            round(&g, told, &d, &[], t(31)),
            GangRound::Tell {
                at,
                pods: vec![PodKey::new("ml", "r2")]
            },
            "a member that appears is told the same time"
        );
        let GangRound::Evict { pods } = round(&g, told, &d, &[], t(60)) else {
            panic!("evicted at the notice")
        };
        assert_eq!(pods.len(), 3);
    }

    #[test]
    fn the_notice_is_at_most_half_the_drains_timeout() {
        let g = gang(vec![member("r0", "a")]);
        let mut d = drain();
        d.timeout = gpuhealth_api::Duration::from_secs(30);
        let GangRound::Tell { at, .. } = round(&g, GangProgress::default(), &d, &[], t(0)) else {
            panic!("told first")
        };
        assert_eq!(at, t(15), "60s asked, 30s to leave in: 15s");
    }

    #[test]
    fn a_member_that_may_not_go_holds_every_member() {
        let mut g = gang(vec![member("r0", "a"), member("r1", "b")]);
        g.members[1].pod.tolerance = Ok(DisruptionTolerance::Never);
        assert!(matches!(
            round(&g, GangProgress::default(), &drain(), &[], t(0)),
            GangRound::Blocked { member, .. } if member == "ml/r1"
        ));
        g.members[1].pod.tolerance = Ok(DisruptionTolerance::Wait);
        assert_eq!(
            round(&g, GangProgress::default(), &drain(), &[], t(0)),
            GangRound::WaitingFor(PodKey::new("ml", "r1"))
        );
        g.members[1].pod.tolerance = Ok(DisruptionTolerance::Evict);
        assert!(matches!(
            round(&g, GangProgress::default(), &drain(), &["ml".into()], t(0)),
            GangRound::Blocked { .. }
        ));
    }

    #[test]
    fn a_gang_restarting_on_its_own_is_not_evicted_twice() {
        let mut g = gang(vec![member("r0", "a"), member("r1", "b")]);
        g.members[0].pod.terminating = true;
        assert_eq!(
            round(&g, GangProgress::default(), &drain(), &[], t(0)),
            GangRound::Leaving { on_its_own: true }
        );
    }

    #[test]
    fn after_the_eviction_only_told_members_are_deleted_again() {
        let told = GangProgress {
            evict_at: Some(t(60)),
            evicted_at: Some(t(60)),
        };
        let mut g = gang(vec![member("r0", "a"), member("new-r0", "a")]);
        g.members[0].pod.evict_at = Some(t(60));
        assert_eq!(
            round(&g, told, &drain(), &[], t(61)),
            GangRound::Evict {
                pods: vec![PodKey::new("ml", "r0")]
            },
            "the old member's delete failed; the restarted one is left alone"
        );
        g.members[0].pod.terminating = true;
        assert_eq!(
            round(&g, told, &drain(), &[], t(62)),
            GangRound::Leaving { on_its_own: false }
        );
    }

    #[test]
    fn a_budget_on_the_gang_is_the_gangs() {
        let mut g = gang(vec![member("r0", "a"), member("r1", "b")]);
        g.budgets.push(BudgetView {
            name: "ml/train".into(),
            allowed: 0,
            pods: vec![PodKey::new("ml", "r0"), PodKey::new("ml", "r1")],
        });
        let mut d = drain();
        d.gangs.notice = gpuhealth_api::Duration::from_secs(0);
        assert!(matches!(
            round(&g, GangProgress::default(), &d, &[], t(0)),
            GangRound::HeldByBudget(_)
        ));
        g.budgets[0].allowed = 1;
        assert!(
            matches!(round(&g, GangProgress::default(), &d, &[], t(0)), GangRound::Evict { pods } if pods.len() == 2),
            "one disruption allowed is the whole gang's"
        );
    }
}
