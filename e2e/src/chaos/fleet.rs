//! The simulated fleet a chaos scenario runs on: GPU nodes served by the
//! real agent binary (fake backend), operator replicas behind one Lease, and
//! the recorder. A trial breaks random nodes, disturbs the system its own
//! way, waits for every sick node to end, checks the invariants over what
//! was recorded, and repairs what a person would.

use std::{collections::BTreeSet, time::Duration};

use gpuhealth_api::{GpuHealthPolicySpec, node_health::Phase};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

use super::{Fault, Rng, inject, repair};
use crate::{
    Result,
    invariants::{
        Expectations, Seen, Target, Violation, carries_cordon_record, check_from, cordoned, ending,
        fences_up, latest_phase, pod_up,
    },
    operator::{self, Options},
    process::Process,
    recorder::Recorder,
    scenario::Scenario,
    wait::until,
};

/// How long a trial's sick nodes may take to end: a takeover after a
/// killed leader, a reset failing, a reboot's wide drain, verification.
pub const SETTLE: Duration = Duration::from_secs(240);

pub struct Fleet {
    pub s: Scenario,
    pub recorder: Recorder,
    pub replicas: Vec<Process>,
    /// Replicas that exited by themselves (a leader that lost its Lease
    /// exits), each replaced as a Deployment would.
    pub exited: Vec<Process>,
    pub lease: String,
    max_concurrent: usize,
    started: usize,
    /// The running trial's start in the recorder, and its sick nodes.
    pub trial_mark: usize,
    pub trial_sick: Vec<String>,
    /// Nodes the run has cordoned itself: nobody else may uncordon them.
    pub foreign_cordons: BTreeSet<String>,
    /// What the checker had to judge, over every trial: evictions and
    /// readable requests seen. A row shows them, so that a checker with
    /// nothing to judge is seen to have had nothing.
    evictions: usize,
    requests: usize,
}

impl Fleet {
    /// `nodes` nodes under `spec` (its `maxConcurrent` an integer), each
    /// with its agent, and `replicas` operator replicas sharing one Lease.
    pub async fn new(
        name: &str,
        nodes: usize,
        spec: GpuHealthPolicySpec,
        replicas: usize,
    ) -> Result<Fleet> {
        Fleet::with_options(name, nodes, spec, replicas, Options::default()).await
    }

    /// Like [`Fleet::new`], its replicas started with `options` (another
    /// release's binary, say).
    pub async fn with_options(
        name: &str,
        nodes: usize,
        spec: GpuHealthPolicySpec,
        replicas: usize,
        options: Options,
    ) -> Result<Fleet> {
        let max_concurrent = match &spec.max_concurrent {
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => *n as usize,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(_) => usize::MAX,
        };
        let mut s = Scenario::new(name, nodes, spec).await?;
        let lease = format!("{}-lease", s.group);
        s.operator_options = Options {
            lease: Some(lease.clone()),
            ..options
        };
        let mut recorder = Recorder::start(&s.client, &s.group, &s.namespace);
        recorder.ready().await?;
        s.start_with_agent_binaries().await?;
        let first = s.operator.take();
        let mut fleet = Fleet {
            s,
            recorder,
            replicas: first.into_iter().collect(),
            exited: Vec::new(),
            lease,
            max_concurrent,
            started: 1,
            trial_mark: 0,
            trial_sick: Vec::new(),
            foreign_cordons: BTreeSet::new(),
            evictions: 0,
            requests: 0,
        };
        while fleet.replicas.len() < replicas {
            fleet.start_replica().await?;
        }
        Ok(fleet)
    }

    /// Starts one more replica behind the Lease.
    pub async fn start_replica(&mut self) -> Result<String> {
        self.start_replica_with(self.s.operator_options.clone())
            .await
    }

    /// Starts one more replica behind the Lease, with `options` (whose
    /// Lease is set to the fleet's); returns its name.
    pub async fn start_replica_with(&mut self, mut options: Options) -> Result<String> {
        self.started += 1;
        let name = format!("{}-replica-{}", self.s.group, self.started);
        options.lease = Some(self.lease.clone());
        let replica = operator::start_with(&name, options).await?;
        self.replicas.push(replica);
        Ok(name)
    }

    /// Replaces every replica by one running `binary` (`None`: this build),
    /// as a Deployment's rolling update does: the new replica started, then
    /// the old one asked to stop (SIGTERM; killed if it has not stopped in
    /// 30 s). Replicas started later run `binary` too.
    pub async fn roll_to(&mut self, binary: Option<std::path::PathBuf>) -> Result<()> {
        self.s.operator_options.binary = binary;
        let old: Vec<String> = self.replicas.iter().map(|r| r.name.clone()).collect();
        for name in old {
            self.start_replica().await?;
            if let Some(mut replica) = self.remove(&name) {
                replica.terminate().await?;
                if replica.exited(Duration::from_secs(30)).await.is_err() {
                    replica.kill().await;
                }
            }
        }
        Ok(())
    }

    /// SIGKILLs every replica but `keep`.
    pub async fn kill_all_but(&mut self, keep: &str) {
        let others: Vec<String> = self
            .replicas
            .iter()
            .map(|r| r.name.clone())
            .filter(|n| n != keep)
            .collect();
        for name in others {
            if let Some(mut other) = self.remove(&name) {
                other.kill().await;
            }
        }
    }

    /// Takes replica `name` out of the fleet, still running if it was.
    pub fn remove(&mut self, name: &str) -> Option<Process> {
        if let Some(i) = self.replicas.iter().position(|r| r.name == name) {
            return Some(self.replicas.remove(i));
        }
        let i = self.exited.iter().position(|r| r.name == name)?;
        Some(self.exited.remove(i))
    }

    /// Says under the scenario's table row what the checker judged, and
    /// how many replicas exited by themselves (and were replaced).
    pub fn add_notes(&self, row: &mut super::Row) {
        let (writes, violations) = self.leadership();
        row.violations.extend(violations);
        row.notes.push(format!(
            "the checker judged {} evictions, {} reset or reboot requests, and {writes} writes by the replicas against the Lease holder of the moment (the API server's audit log)",
            self.evictions, self.requests
        ));
        if !self.exited.is_empty() {
            row.notes.push(format!(
                "{} replica(s) exited on losing the Lease and were replaced, as a Deployment would",
                self.exited.len()
            ));
        }
    }

    /// The writes the fleet's replicas made, and those made by one that
    /// did not hold the Lease then, from the API server's audit log; a
    /// cluster that keeps none is a violation, since leadership then goes
    /// unjudged.
    fn leadership(&self) -> (usize, Vec<Violation>) {
        let kubeconfig = std::env::var(crate::cluster::KUBECONFIG_ENV).unwrap_or_default();
        let log = crate::audit::log_beside(std::path::Path::new(&kubeconfig));
        match std::fs::read_to_string(&log) {
            Ok(text) => {
                let (writes, mut violations) =
                    crate::audit::writes_without_lease(&text, &self.lease, &self.s.group);
                // None attributed: the replicas' User-Agent is not what the
                // judge reads, and it would pass having judged nothing.
                if writes == 0 {
                    violations.push(Violation::Missing {
                        what: format!(
                            "no write of {}'s replicas in the audit log at {}",
                            self.s.group,
                            log.display()
                        ),
                    });
                }
                (writes, violations)
            }
            Err(e) => (
                0,
                vec![Violation::Missing {
                    what: format!(
                        "no audit log at {} ({e}): start the cluster with GPUHEALTH_CLUSTER_AUDIT=1, as make chaos does",
                        log.display()
                    ),
                }],
            ),
        }
    }

    /// Replaces each replica that has exited by a new one, as a
    /// Deployment's ReplicaSet would.
    pub async fn replace_exited(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.replicas.len() {
            if self.replicas[i].has_exited() {
                let gone = self.replicas.remove(i);
                eprintln!("chaos: {} exited; starting a replacement", gone.name);
                self.exited.push(gone);
                self.start_replica().await?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Waits until `done` holds for what was recorded since `mark`,
    /// replacing replicas that exit meanwhile.
    pub async fn settle(
        &mut self,
        mark: usize,
        what: &str,
        done: impl Fn(&[Seen]) -> bool,
    ) -> Result<()> {
        let deadline = std::time::Instant::now() + SETTLE;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let waited = self
                .recorder
                .until(mark, what, left.min(Duration::from_secs(5)), &done)
                .await;
            if waited.is_ok() {
                return waited;
            }
            if left.is_zero() {
                self.say_where_stuck(mark);
                return Err(crate::HarnessError::Timeout {
                    what: what.to_owned(),
                    secs: SETTLE.as_secs(),
                });
            }
            self.replace_exited().await?;
        }
    }

    /// What a wait that timed out was waiting on, for the run's output
    /// (a CI run keeps no logs): the trial's sick nodes as last seen, and
    /// the end of each replica's log.
    fn say_where_stuck(&self, mark: usize) {
        let timeline = self.recorder.since(mark);
        for node in &self.trial_sick {
            let last = |want: fn(&Seen) -> bool| {
                timeline
                    .iter()
                    .rev()
                    .find(|s| seen_on(s, node) && want(s))
                    .map_or("-".to_owned(), |s| format!("{s:?}"))
            };
            eprintln!(
                "chaos: stuck? {node}: {} | {} | rules up {}",
                last(|s| matches!(s, Seen::Health { .. })),
                last(|s| matches!(s, Seen::Cordon { .. })),
                fences_up(&timeline, node),
            );
        }
        for replica in &self.replicas {
            let log = replica.log_text();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            eprintln!("chaos: the end of {}'s log:", replica.name);
            for line in tail.into_iter().rev() {
                eprintln!("  {line}");
            }
        }
    }

    /// The replica holding the Lease, by name.
    pub async fn leader(&self) -> Result<Option<String>> {
        let leases: Api<Lease> = Api::namespaced(self.s.client.clone(), "default");
        Ok(leases
            .get_opt(&self.lease)
            .await?
            .and_then(|l| l.spec?.holder_identity))
    }

    /// Waits until a running replica holds the Lease (a dead leader's
    /// Lease is taken over once it expires), and names it.
    pub async fn live_leader(&self) -> Result<String> {
        let leases: Api<Lease> = Api::namespaced(self.s.client.clone(), "default");
        let live: Vec<&str> = self.replicas.iter().map(|r| r.name.as_str()).collect();
        let holder = |l: &Lease| l.spec.as_ref().and_then(|s| s.holder_identity.clone());
        let lease = until(leases, &self.lease, SETTLE, |l| {
            holder(l).is_some_and(|h| live.contains(&h.as_str()))
        })
        .await?;
        Ok(holder(&lease).unwrap_or_default())
    }

    /// Stalls the leader where it is (SIGSTOP), as a replica starved of CPU
    /// would be, and names it for [`Fleet::resume`]. Resumed within its
    /// renew deadline, it goes on leading.
    pub async fn stall_leader(&mut self) -> Result<String> {
        self.replace_exited().await?;
        let leader = self.live_leader().await?;
        if let Some(replica) = self.replicas.iter().find(|r| r.name == leader) {
            replica.stall().await?;
            eprintln!("chaos: stalled the leader {leader}");
        }
        Ok(leader)
    }

    /// Lets replica `name`, stalled, go on.
    pub async fn resume(&self, name: &str) -> Result<()> {
        match self.replicas.iter().find(|r| r.name == name) {
            Some(replica) => replica.resume().await,
            None => Ok(()),
        }
    }

    /// SIGKILLs the leader and starts a replacement, as a Deployment would.
    pub async fn kill_leader(&mut self) -> Result<()> {
        self.replace_exited().await?;
        let leader = self.live_leader().await?;
        if let Some(mut dead) = self.remove(&leader) {
            dead.kill().await;
            eprintln!("chaos: SIGKILLed the leader {}", dead.name);
        }
        self.start_replica().await.map(|_| ())
    }

    /// Waits until one of the trial's sick nodes is in `phase`, or all have
    /// ended without (not every fault passes through every phase).
    pub async fn reached(&self, phase: Phase) -> Result<()> {
        let sick = &self.trial_sick;
        self.recorder
            .until(self.trial_mark, &format!("{phase:?}"), SETTLE, |t| {
                sick.iter().all(|n| ending(t, n).is_some())
                    || t.iter().any(|s| {
                        matches!(s, Seen::Health { node, phase: p, .. } if *p == phase && sick.contains(node))
                    })
            })
            .await
    }

    fn expectations(&self) -> Expectations {
        Expectations {
            max_concurrent: [(self.s.policy.clone(), self.max_concurrent)].into(),
            foreign_cordons: self.foreign_cordons.clone(),
            ..Default::default()
        }
    }

    /// One trial: `faulty` random nodes get faults of random `kinds`;
    /// `disturb` runs at once (and says what it expected and did not see);
    /// every sick node must end as its fault says. Returns what was
    /// expected and what broke, after repairing `Failed` nodes.
    pub async fn trial(
        &mut self,
        rng: &mut Rng,
        faulty: usize,
        kinds: &[Fault],
        disturb: impl AsyncFnOnce(&mut Fleet, &mut Rng) -> Result<Vec<Violation>>,
    ) -> Result<(Expectations, Vec<Violation>)> {
        let mark = self.recorder.mark();
        let mut expect = self.expectations();
        let mut faults = Vec::new();
        for node in rng.pick(&self.s.nodes, faulty) {
            let fault = kinds[rng.below(kinds.len())];
            let holder = format!("never-{}-{mark}", node);
            let gpu = rng.below(8);
            eprintln!("chaos: {node}: GPU {gpu} {fault:?}");
            expect.sick.insert(node.clone(), fault.ending());
            faults.push((node, gpu, fault, holder));
        }
        // All at once: one after the other, a loaded machine spaced them
        // seconds apart, and a storm of three became three single faults.
        futures::future::try_join_all(
            faults
                .iter()
                .map(|(node, gpu, fault, holder)| inject(&self.s, node, *gpu, *fault, holder)),
        )
        .await?;
        let holders: Vec<(String, String)> = faults
            .into_iter()
            .map(|(node, _, _, holder)| (node, holder))
            .collect();
        let sick: Vec<String> = expect.sick.keys().cloned().collect();
        self.trial_mark = mark;
        self.trial_sick = sick.clone();
        let missed = disturb(self, rng).await?;
        // A recovered node's rules go, and its cordon is lifted (unless a
        // person's), after its status says so: the status is written first.
        let foreign = self.foreign_cordons.clone();
        let back_in_service = |t: &[Seen], n: &String| {
            fences_up(t, n) == 0 && (foreign.contains(n) || cordoned(t, n) != Some(true))
        };
        let waited = self
            .settle(mark, "every sick node to end", |t| {
                sick.iter().all(|n| {
                    let end = ending(t, n);
                    end.is_some() && (end != Some(Phase::Healthy) || back_in_service(t, n))
                })
            })
            .await;
        let ended = self.recorder.mark();
        let history = self.recorder.since(0);
        let judged = &history[mark..ended];
        self.evictions += judged
            .iter()
            .filter(|s| matches!(s, Seen::PodGone { evicted: true, .. }))
            .count();
        self.requests += judged
            .iter()
            .filter(|s| matches!(s, Seen::Request { target, .. } if *target != Target::Unreadable))
            .count();
        let mut violations = check_from(&history[..ended], mark, &expect);
        violations.extend(missed);
        if let Err(e) = waited {
            eprintln!("chaos: {e}");
        }

        // What a person does for the nodes handed over; then every node is
        // back in service before the next trial.
        let timeline = self.recorder.since(mark);
        let handed_over: Vec<String> = holders
            .iter()
            .map(|(n, _)| n.clone())
            .filter(|n| ending(&timeline, n) != Some(Phase::Healthy))
            .collect();
        let after = self.recorder.mark();
        for (node, holder) in holders.iter().filter(|(n, _)| handed_over.contains(n)) {
            repair(&self.s, node, holder).await?;
        }
        // Counted from the trial's start, so that a rule put up before the
        // repair is seen to go. The person's uncordon leaves gpuhealth's
        // record of its cordon, which the operator must remove: left, it
        // would claim the person's next cordon as gpuhealth's.
        // A node that never comes back is this trial's violation, reported
        // with the others, not an error that would drop them. The person's
        // deletions must be recorded too: one the pods' watch reports late
        // (it backs off after an API server restart) would otherwise fall
        // into the next trial, where no deletion is the run's.
        let deleted: Vec<String> = holders
            .iter()
            .filter(|(n, _)| handed_over.contains(n))
            .map(|(_, h)| format!("{}/{h}", self.s.namespace))
            .collect();
        if let Err(e) = self
            .settle(mark, "repaired nodes back in service", |t| {
                handed_over.iter().all(|n| {
                    latest_phase(t, n) == Some(Phase::Healthy)
                        && fences_up(t, n) == 0
                        && carries_cordon_record(t, n) != Some(true)
                }) && deleted.iter().all(|pod| !pod_up(t, pod))
            })
            .await
        {
            violations.push(Violation::Missing {
                what: e.to_string(),
            });
        }
        let mut later = self.expectations();
        // A person's repair uncordons the nodes handed over, foreign or not.
        later.foreign_cordons.retain(|n| !handed_over.contains(n));
        later.deleted_by_run = deleted.into_iter().collect();
        violations.extend(check_from(&self.recorder.since(0), after, &later));
        Ok((expect, violations))
    }
}

/// Whether `seen` is about `node`.
fn seen_on(seen: &Seen, node: &str) -> bool {
    match seen {
        Seen::Health { node: n, .. }
        | Seen::Cordon { node: n, .. }
        | Seen::Hardware { node: n, .. }
        | Seen::Executed { node: n, .. }
        | Seen::Request { node: n, .. }
        | Seen::Fence { node: n, .. }
        | Seen::Claimed { node: n, .. } => n == node,
        Seen::PodUp { .. } | Seen::PodGone { .. } => false,
    }
}
