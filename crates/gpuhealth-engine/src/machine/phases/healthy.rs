//! `Healthy` and `Suspect`: whether to act, and what holds it back.

use std::time::Duration;

use gpuhealth_api::{
    RecoveryAction,
    contract::{MaintenanceNotice, NEEDS_REPLACEMENT_LABEL},
    node_health::{MaintenanceStatus, Phase, Plan},
    policy::Mode,
    vocabulary::Reason,
};

use crate::budget;

use crate::machine::{
    Action, POLL,
    core::{Stepper, Then},
    maintenance_headline,
};

/// What there is to act on: a signal, or a maintenance notice whose time
/// has come.
struct Trigger {
    notice: Option<MaintenanceNotice>,
    required: Option<RecoveryAction>,
    /// Both in words, for the status message.
    headline: String,
}

/// Why a node with something to act on stays `Suspect` for now.
struct Hold {
    reason: Reason,
    why: String,
    /// When to look again, if nothing changes before.
    recheck: Option<Duration>,
    /// What the step asks for or records with it.
    with: Also,
}

/// What a hold asks for or records beside the node's staying `Suspect`.
enum Also {
    Nothing,
    /// The budget, not counted yet: the step ends, and `step` asks for it.
    BudgetNeeded,
    /// A DryRun policy's plan of what it would do.
    Plan(Box<Plan>),
}

/// What may hold a node back from acting, in order: the first that holds
/// wins (a paused policy says so even while the budget is spent).
const HOLDS: [fn(&Stepper<'_>, &Trigger) -> Option<Hold>; 5] = [
    not_enforced,
    paused,
    disrupted_by_other,
    out_of_budget,
    dry_run,
];

fn not_enforced(s: &Stepper<'_>, t: &Trigger) -> Option<Hold> {
    s.input.not_enforced.map(|held| Hold {
        reason: held.reason,
        why: format!("{}; would act on: {}", held.why, t.headline),
        recheck: None,
        with: Also::Nothing,
    })
}

fn paused(s: &Stepper<'_>, t: &Trigger) -> Option<Hold> {
    (s.spec().mode == Mode::Paused).then(|| Hold {
        reason: Reason::Paused,
        why: format!("policy is Paused; would act on: {}", t.headline),
        recheck: None,
        with: Also::Nothing,
    })
}

fn disrupted_by_other(s: &Stepper<'_>, t: &Trigger) -> Option<Hold> {
    let others = &s.input.node.disrupted_by;
    (!others.is_empty()).then(|| Hold {
        reason: Reason::DisruptedByOther,
        why: format!(
            "another tool is disrupting the node ({}); gpuhealth starts nothing until it is done; waiting to act on: {}",
            others.join("; "),
            t.headline
        ),
        recheck: Some(POLL),
        with: Also::Nothing,
    })
}

fn out_of_budget(s: &Stepper<'_>, t: &Trigger) -> Option<Hold> {
    let Some(b) = s.input.budget else {
        return Some(Hold {
            reason: budget::Hold::Concurrency.reason(),
            why: "the budget is not counted yet".to_owned(),
            recheck: None,
            with: Also::BudgetNeeded,
        });
    };
    let b = if s.headline_reason() == Reason::RepairedWithGang {
        b.brought_forward()
    } else {
        b
    };
    let hold = b.may_start().err()?;
    let why = match hold {
        budget::Hold::CircuitOpen => format!(
            "{} of the policy's nodes are unhealthy, more than maxUnhealthy allows ({}); no new remediation starts",
            b.unhealthy, b.max_unhealthy
        ),
        budget::Hold::Concurrency => format!(
            "{} node(s) already being remediated and {} disrupted by other tools (maxConcurrent {})",
            b.disruptive_elsewhere, b.disrupted_by_others, b.max_concurrent
        ),
        budget::Hold::Guardrail => {
            let (disrupted, max) = b.across_policies.unwrap_or_default();
            format!(
                "{disrupted} node(s) disrupted across all policies, the most the cluster allows ({max}, --max-disrupted-nodes)"
            )
        }
    };
    Some(Hold {
        reason: hold.reason(),
        why: format!("{why}; waiting to act on: {}", t.headline),
        recheck: Some(POLL),
        with: Also::Nothing,
    })
}

/// A DryRun policy records what it would do instead of doing it.
fn dry_run(s: &Stepper<'_>, t: &Trigger) -> Option<Hold> {
    if s.spec().mode != Mode::DryRun {
        return None;
    }
    let (action, what) = match (&t.notice, t.required) {
        (Some(_), _) | (None, None) => (
            RecoveryAction::NodeReboot,
            "drain for maintenance".to_owned(),
        ),
        (None, Some(r)) => (r, format!("{r:?}")),
    };
    Some(Hold {
        reason: Reason::DryRun,
        why: format!("DryRun: would quarantine and {what} for: {}", t.headline),
        // The plan says what would happen now: pods, budgets and other
        // tools' holds change without a word to this node.
        recheck: Some(POLL),
        with: Also::Plan(Box::new(s.dry_run_plan(action))),
    })
}

impl Stepper<'_> {
    pub(super) fn healthy_or_suspect(&mut self) -> Then {
        self.status.plan = None;
        self.watch_workloads();
        let notice = self.maintenance_due();
        let required = self.diagnosis.required();
        if required.is_none() && notice.is_none() {
            self.nothing_to_act_on();
            return Then::Done;
        }
        let headline = match &notice {
            Some(n) => maintenance_headline(n),
            None => self.headline(),
        };
        let trigger = Trigger {
            notice,
            required,
            headline,
        };
        // A fence already made for this trigger (its status never written)
        // is carried on, whatever would hold a new start back: its budget
        // was counted when it was made.
        let adopting = self.unrecorded_fence().is_some();
        if !adopting && let Some(hold) = HOLDS.iter().find_map(|check| check(self, &trigger)) {
            match hold.with {
                Also::Nothing => {}
                Also::BudgetNeeded => self.budget_needed = true,
                Also::Plan(plan) => self.status.plan = Some(*plan),
            }
            self.enter(Phase::Suspect, hold.reason, hold.why);
            if let Some(after) = hold.recheck {
                self.wait(after);
            }
            return Then::Done;
        }
        self.act_on(trigger);
        Then::Done
    }

    /// No firm signal, no maintenance due: a signal may be on its way, or
    /// the node is healthy (and a cordon of ours left over is lifted).
    fn nothing_to_act_on(&mut self) {
        match self.diagnosis.pending_until {
            Some(at) => {
                let left = at
                    .duration_since(self.now())
                    .try_into()
                    .unwrap_or(Duration::ZERO);
                self.enter(
                    Phase::Suspect,
                    Reason::SignalPending,
                    "a signal holds but not yet for its `for` duration".into(),
                );
                self.wait(left);
            }
            None => {
                let ours = self.leftover_cordon().or_else(|| self.unrecorded_cordon());
                if let Some(incident) = ours {
                    self.actions.push(Action::Uncordon { incident });
                }
                self.back_in_service()
            }
        }
    }

    /// Nothing holds it back: an incident opens, and the node is
    /// quarantined for it (or handed over, if it is a repeat offender).
    fn act_on(&mut self, trigger: Trigger) {
        let headline = trigger.headline;
        if let Some(notice) = trigger.notice {
            let taken = self.open_incident(
                headline.clone(),
                Vec::new(),
                Some(notice.deadline.clone()),
                None,
            );
            self.status.maintenance = Some(MaintenanceStatus {
                deadline: notice.deadline,
                source: notice.source,
                reason: notice.reason,
                drained_at: None,
            });
            self.enter(
                Phase::Quarantined,
                Reason::MaintenanceScheduled,
                format!("{} ahead of {headline}", taken.done()),
            );
            return;
        }
        let gpus = self.diagnosis.gpus();
        let signals = &self.diagnosis.signals;
        let app_faults_alone =
            !signals.is_empty() && signals.iter().all(|s| s.reason == Reason::RepeatedAppXids);
        if let Some(why) = self.repeat_offender(&gpus).filter(|_| !app_faults_alone) {
            self.open_incident(
                headline.clone(),
                gpus,
                None,
                Some(RecoveryAction::ReplaceNode),
            );
            self.actions.push(Action::LabelNode {
                key: NEEDS_REPLACEMENT_LABEL.into(),
                value: "true".into(),
            });
            return self.fail(
                Reason::RepeatedFailures,
                format!(
                    "{why}: handed over for replacement instead of another remediation; the node stays cordoned and is labelled {NEEDS_REPLACEMENT_LABEL}=true (now: {headline})"
                ),
            );
        }
        let step = trigger.required.map(|r| self.first_step(r).unwrap_or(r));
        let taken = self.open_incident(headline.clone(), gpus, None, step);
        self.enter(
            Phase::Quarantined,
            self.headline_reason(),
            format!("{} for: {headline}", taken.done()),
        );
    }
}
