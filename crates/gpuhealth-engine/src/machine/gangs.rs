//! Gangs in a drain: the members of a gang that holds a GPU the step acts
//! on leave as the policy's `drain.gangs.mode` says, and the incident
//! records each gang and how it left.

use gpuhealth_api::{
    gang::{GANG_NODES_LIMIT, GANGS_LIMIT, GangKey, GangMode, GangRecord},
    node_health::ActionStatus,
    vocabulary::PodKey,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::{
    drain::DrainPlan,
    gangs::{self, GangProgress, GangRound, GangView},
    happening::Happening,
};

use super::{Action, core::Stepper};

impl Stepper<'_> {
    /// Takes the members of gangs out of `plan`'s evictions and plays each
    /// gang's round (see [`gangs::round`]) for the attempt `action`.
    pub(super) fn gang_rounds(&mut self, plan: &mut DrainPlan, action: &ActionStatus) {
        let mode = self.spec().drain.gangs.mode;
        for key in self.gangs_to_evict(plan) {
            let on_node: Vec<PodKey> = plan
                .evict
                .iter()
                .filter(|p| self.gang_of(p).as_ref() == Some(&key))
                .cloned()
                .collect();
            let view = self.input.gangs.iter().find(|g| g.key == key);
            self.record_gang(&key, mode, view);
            if mode == GangMode::Member {
                continue;
            }
            plan.evict.retain(|p| !on_node.contains(p));
            if mode == GangMode::Never {
                let why = format!(
                    "one of {key}, and drain.gangs.mode is Never: the gang's controller or a person moves it"
                );
                plan.blocked
                    .extend(on_node.into_iter().map(|p| (p, why.clone())));
                continue;
            }
            let Some(view) = view else {
                plan.with_gang.extend(on_node);
                plan.gangs
                    .push(format!("{key}: its members are read at the next look"));
                continue;
            };
            self.whole_gang_round(plan, view, on_node, action);
        }
    }

    fn whole_gang_round(
        &mut self,
        plan: &mut DrainPlan,
        view: &GangView,
        on_node: Vec<PodKey>,
        action: &ActionStatus,
    ) {
        let key = &view.key;
        let here = self.input.node.name.as_str();
        let own = self.gang_progress(key).evict_at;
        if let Some(lead) = self
            .input
            .gang_windows
            .iter()
            .filter(|w| &w.gang == key && w.leads(here, own))
            .min_by_key(|w| (w.evict_at, w.node.clone()))
        {
            // Another incident took this gang first: it tells and deletes
            // every member, these included; a second notice would race it.
            plan.gangs.push(format!(
                "{key} leaves with incident {} of node {}, told for {}",
                lead.incident, lead.node, lead.evict_at
            ));
            plan.with_gang.extend(on_node);
            return;
        }
        let never = &self.input.guardrails.never_drain;
        let round = gangs::round(
            view,
            self.gang_progress(key),
            &self.spec().drain,
            never,
            self.now(),
        );
        let members = view.live().count();
        let nodes = view.nodes().len();
        match round {
            GangRound::Blocked { member, why } => {
                let why = format!(
                    "one of {key}, which leaves whole, and its member {member} may not be evicted ({why}): no member is"
                );
                plan.blocked
                    .extend(on_node.into_iter().map(|p| (p, why.clone())));
                return;
            }
            GangRound::WaitingFor(member) => plan.gangs.push(format!(
                "{key} waits for its member {member} to finish (disruption tolerance `wait`), then leaves whole"
            )),
            GangRound::Leaving { on_its_own: true } => {
                if let Some(r) = self.gang_record(key) {
                    r.restarted_on_its_own = true;
                }
                plan.gangs.push(format!(
                    "{key} is restarting on its own (members terminating): it is not evicted twice"
                ));
            }
            GangRound::Leaving { on_its_own: false } => {
                plan.gangs.push(format!("{key}: its members are leaving"))
            }
            GangRound::Tell { at, pods } => {
                if let Some(r) = self.gang_record(key) {
                    r.evict_at.get_or_insert(Time(at));
                }
                let why = format!(
                    "{:?} {} of node {} acts on a GPU a member of {key} holds: its {members} members on {nodes} nodes leave together at {at}",
                    action.type_, action.id, self.input.node.name
                );
                if !pods.is_empty() && pods.len() == members {
                    self.happenings.push(Happening::GangTold {
                        gang: key.clone(),
                        members: members as u32,
                        at,
                    });
                }
                self.actions.extend(pods.into_iter().map(|pod| Action::TellGangMember {
                    pod,
                    at,
                    why: why.clone(),
                }));
                plan.gangs.push(format!(
                    "{key}: {members} members on {nodes} nodes told; they leave together at {at}"
                ));
            }
            GangRound::HeldByBudget(budgets) => plan.gang_budgets.push(format!(
                "{}, which covers {key}: the gang leaves whole when it allows a disruption",
                budgets.join("; ")
            )),
            GangRound::Evict { pods } => {
                let now = self.now();
                if let Some(r) = self.gang_record(key) {
                    r.evict_at.get_or_insert(Time(now));
                    r.evicted_at.get_or_insert(Time(now));
                }
                let why = format!(
                    "{key} leaves whole: {:?} {} of node {} acts on a GPU one of its members holds",
                    action.type_, action.id, self.input.node.name
                );
                if pods.len() == members {
                    self.happenings.push(Happening::GangEvicted {
                        gang: key.clone(),
                        members: members as u32,
                        nodes: nodes as u32,
                    });
                }
                for pod in pods {
                    self.note_evicted(&pod);
                    self.actions.push(Action::EvictGangMember {
                        pod,
                        why: why.clone(),
                    });
                }
                plan.gangs
                    .push(format!("{key}: {members} members on {nodes} nodes evicted together"));
            }
        }
        plan.with_gang.extend(on_node);
    }

    /// What a drain of `plan` would do with each gang of its pods, in
    /// words, for a `DryRun` plan.
    pub(super) fn planned_gangs(&self, plan: &DrainPlan) -> Vec<String> {
        let mode = self.spec().drain.gangs.mode;
        let never = &self.input.guardrails.never_drain;
        self.gangs_to_evict(plan)
            .into_iter()
            .map(|key| {
                let view = self.input.gangs.iter().find(|g| g.key == key);
                let whole = match (mode, view) {
                    (GangMode::Member, _) => {
                        return format!("{key} (Member): only its pods on these GPUs would be evicted");
                    }
                    (GangMode::Never, _) => {
                        return format!("{key} (Never): its pods would hold the step");
                    }
                    (GangMode::Whole, None) => return format!("{key} (Whole): its members not read"),
                    (GangMode::Whole, Some(view)) => view,
                };
                let (members, nodes) = (whole.live().count(), whole.nodes().len());
                let notice = gpuhealth_api::Duration::from_secs(
                    gangs::notice(&self.spec().drain).as_secs(),
                );
                let round = gangs::round(whole, GangProgress::default(), &self.spec().drain, never, self.now());
                match round {
                    GangRound::Blocked { member, why } => format!(
                        "{key} (Whole): its {members} members would stay, as {member} may not be evicted ({why})"
                    ),
                    GangRound::WaitingFor(member) => format!(
                        "{key} (Whole): its {members} members would wait for {member} to finish, then leave together"
                    ),
                    GangRound::Leaving { .. } => format!(
                        "{key} (Whole): restarting on its own; it would not be evicted again"
                    ),
                    _ => format!(
                        "{key} (Whole): its {members} members on {nodes} nodes would be told, then deleted together after {notice}"
                    ),
                }
            })
            .collect()
    }

    /// The gangs of the pods `plan` would evict, in their order.
    fn gangs_to_evict(&self, plan: &DrainPlan) -> Vec<GangKey> {
        let mut keys: Vec<GangKey> = Vec::new();
        for pod in &plan.evict {
            if let Some(key) = self.gang_of(pod)
                && !keys.contains(&key)
            {
                keys.push(key);
            }
        }
        keys
    }

    /// The gang of the pod `key` on this node, if it is one of a gang.
    fn gang_of(&self, key: &PodKey) -> Option<GangKey> {
        self.input
            .pods
            .iter()
            .find(|p| &p.key() == key)
            .and_then(|p| p.gang.clone())
    }

    /// What the open incident has done with `key` so far.
    fn gang_progress(&self, key: &GangKey) -> GangProgress {
        let record = self
            .status
            .history
            .first()
            .and_then(|i| i.gangs.iter().find(|g| &g.gang == key));
        GangProgress {
            evict_at: record.and_then(|r| r.evict_at.as_ref()).map(|t| t.0),
            evicted_at: record.and_then(|r| r.evicted_at.as_ref()).map(|t| t.0),
        }
    }

    fn gang_record(&mut self, key: &GangKey) -> Option<&mut GangRecord> {
        self.status
            .history
            .first_mut()?
            .gangs
            .iter_mut()
            .find(|g| &g.gang == key)
    }

    /// Records `key` on the open incident, with its members as seen now.
    fn record_gang(&mut self, key: &GangKey, mode: GangMode, view: Option<&GangView>) {
        let Some(incident) = self.status.history.first_mut() else {
            return;
        };
        if !incident.gangs.iter().any(|g| &g.gang == key) {
            if incident.gangs.len() >= GANGS_LIMIT {
                return;
            }
            incident.gangs.push(GangRecord {
                gang: key.clone(),
                mode,
                members: 0,
                nodes: Vec::new(),
                evict_at: None,
                evicted_at: None,
                restarted_on_its_own: false,
            });
        }
        let (Some(record), Some(view)) = (incident.gangs.iter_mut().find(|g| &g.gang == key), view)
        else {
            return;
        };
        // Counted until the gang leaves: after, its members are the
        // restarted gang's.
        if record.evicted_at.is_none() {
            record.mode = mode;
            record.members = u32::try_from(view.live().count()).unwrap_or(u32::MAX);
            record.nodes = view
                .nodes()
                .into_iter()
                .take(GANG_NODES_LIMIT)
                .map(str::to_owned)
                .collect();
        }
    }
}
