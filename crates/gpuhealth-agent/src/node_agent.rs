//! The agent's loop on its own Node: carry out new requests (each id at most
//! once; the executor's part), then publish the GPU report and the `GpuHealthy` condition when
//! they change, again every `refresh` so that a reader can tell a live
//! report from a stale one, and at once when another writer has overwritten
//! the report. GPUs that cannot be read are said so, in the report, the
//! condition and the agent's readiness.
//!
//! Long because the agent's one loop (serve requests, then publish) and the
//! tests of each of its orderings belong together.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::Notify;

use futures::{StreamExt, TryStreamExt};
use gpuhealth_api::contract::{
    AnnotationValue, DIAGNOSTICS_REQUEST_ANNOTATION, DiagnosticsLevel, DiagnosticsRequest,
    GPU_HEALTHY_CONDITION, GPU_REPORT_ANNOTATION, GpuEntry, GpuReport, Outcome,
    REBOOT_REQUEST_ANNOTATION, REQUEST_RESULT_ANNOTATION, RESET_REQUEST_ANNOTATION, RebootRequest,
    RequestId, RequestResult, ResetRequest,
};
use gpuhealth_api::{GpuHealth, GpuNodeHealth};
use k8s_openapi::{
    api::{core::v1::Node, events::v1 as events},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time},
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::Patch,
    runtime::{WatchStreamExt, watcher},
};
use serde_json::json;
use tracing::{error, info, warn};

use crate::{
    authority::{self, Asked},
    backend::Backend,
    diagnostics::{self, Dcgm},
    journal::{self, Journal, JournalError, Seen},
    metrics::{AgentMetrics, RefusalLabels, RequestLabels, ResultLabels},
    withheld::Announced,
};

/// Test hook (`GPUHEALTH_TEST_CRASH_AFTER`): exit at a step of carrying out a
/// request, as a crash there would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// The journal says begun; nothing carried out yet.
    Begun,
    /// Carried out and journalled; the result not yet written.
    Finished,
}

/// The least time between two report writes unless a GPU has newly gone
/// bad or named its first Xid: a flood of Xids (100,000 kernel log lines a
/// second in the reliability test) becomes one write a second, not one per
/// Xid. A GPU going bad, or its first Xid, is written at once: it is what
/// the operator must act on.
pub const COALESCE: Duration = Duration::from_secs(1);

/// How long to wait after `failures` report writes in a row failed: half a
/// second, doubling, at most 30 s.
fn retry_delay(failures: u32) -> Duration {
    let doubled =
        Duration::from_millis(500).saturating_mul(1 << failures.clamp(1, 7).saturating_sub(1));
    doubled.min(Duration::from_secs(30))
}

/// The longest a request may keep the loop busy: a reset's wait for holders
/// to let go, nvidia-smi, and the wait for the kubelet, with room to spare.
pub const REQUEST_MAY_TAKE: Duration = Duration::from_secs(15 * 60);

/// How long a refused request is passed over before it is looked at again.
pub const RECHECK_REFUSED: Duration = Duration::from_secs(30);

/// Which part of the agent a process is. On a real node the two run in
/// pods of their own, each with only the privileges its part needs
/// (docs/security.md); they meet through [`crate::handoff`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Reads the GPUs and publishes the report and the `GpuHealthy` condition.
    Reporter,
    /// Carries out the operator's reset, reboot and diagnostics requests.
    Executor,
    /// Both parts in one process (a simulated node).
    Both,
}

impl Role {
    pub fn reports(self) -> bool {
        self != Role::Executor
    }

    pub fn executes(self) -> bool {
        self != Role::Reporter
    }
}

pub struct Settings {
    pub node: String,
    pub role: Role,
    /// How often to read the GPUs when nothing on the Node changes.
    pub poll: Duration,
    /// How often to write the report and the `GpuHealthy` condition's
    /// heartbeat when nothing changes: how a reader tells a live report from
    /// a stale one.
    pub refresh: Duration,
    /// Requests older than this are not carried out.
    pub request_max_age: Duration,
    pub crash_after: Option<CrashPoint>,
    /// Where the executor's DCGM diagnostics run.
    pub dcgm: Dcgm,
}

pub struct NodeAgent<B> {
    client: Client,
    settings: Settings,
    backend: B,
    /// The executor's: what it has begun and finished.
    journal: Option<Journal>,
    /// What this process last wrote: the report and the condition.
    published: Option<GpuReport>,
    /// Whether the Node, as the watch shows it, has caught up with the last
    /// write: until then an older report there is no overwrite.
    caught_up: bool,
    /// When the report was last written, and whether a change waits for
    /// [`COALESCE`] to pass.
    last_write: Option<std::time::Instant>,
    deferred: bool,
    /// Report writes refused or failed in a row, and when the next may go:
    /// without it an API server that refuses connections had every agent
    /// retry its due refresh in a tight loop.
    write_failures: u32,
    retry_at: Option<std::time::Instant>,
    condition: Option<(&'static str, Timestamp)>,
    /// Signalled when the backend has news (a kernel log line), so the agent
    /// need not wait for its next poll.
    wake: Arc<Notify>,
    metrics: Arc<AgentMetrics>,
    /// Requests refused by this process, and when last looked at: said
    /// once each (log, metric, Event), looked at again after
    /// [`RECHECK_REFUSED`] in case the operator has since made the same
    /// request (an id written early by someone else must not block it).
    refused: HashMap<String, Instant>,
    /// The executor's: what it has said of its capability checks.
    announced: Announced,
}

/// A request on the node, of any kind.
struct Request {
    id: RequestId,
    requested_at: Timestamp,
    kind: Kind,
}

/// What a request asks for.
enum Kind {
    Reset {
        gpus: Vec<String>,
    },
    Reboot,
    Diagnostics {
        gpus: Vec<String>,
        level: DiagnosticsLevel,
        timeout: gpuhealth_api::Duration,
    },
}

/// A Warning Event about the Node: `RequestRefused`, saying why; one per
/// request, named after it.
fn refusal_event(node: &Node, request: &str, instance: &str, message: String) -> events::Event {
    let mut name = format!("{}.refused-{request}", node.name_any());
    name.truncate(253);
    events::Event {
        metadata: ObjectMeta {
            name: Some(name.trim_end_matches(['-', '.']).to_owned()),
            namespace: Some("default".into()),
            ..Default::default()
        },
        event_time: Some(MicroTime(Timestamp::now())),
        type_: Some("Warning".into()),
        reason: Some("RequestRefused".into()),
        action: Some("CarryOutRequest".into()),
        note: Some(message.chars().take(1000).collect()),
        regarding: Some(node.object_ref(&())),
        reporting_controller: Some("gpuhealth.io/agent".into()),
        reporting_instance: Some(instance.chars().take(128).collect()),
        ..Default::default()
    }
}

impl Request {
    /// The metrics' `kind` label.
    fn kind(&self) -> &'static str {
        match self.kind {
            Kind::Reset { .. } => "reset",
            Kind::Reboot => "reboot",
            Kind::Diagnostics { .. } => "diagnostics",
        }
    }

    /// How long carrying it out may keep the loop busy.
    fn may_take(&self) -> Duration {
        match &self.kind {
            Kind::Diagnostics { timeout, .. } => {
                REQUEST_MAY_TAKE.max(timeout.as_std() + Duration::from_secs(60))
            }
            Kind::Reset { .. } | Kind::Reboot => REQUEST_MAY_TAKE,
        }
    }
}

impl<B: Backend> NodeAgent<B> {
    /// `journal` is the executor's, and must be given where `settings.role`
    /// executes.
    pub fn new(client: Client, settings: Settings, backend: B, journal: Option<Journal>) -> Self {
        NodeAgent {
            client,
            settings,
            backend,
            journal,
            published: None,
            caught_up: false,
            last_write: None,
            deferred: false,
            write_failures: 0,
            retry_at: None,
            condition: None,
            wake: Arc::default(),
            metrics: Arc::default(),
            refused: HashMap::new(),
            announced: Announced::default(),
        }
    }

    pub fn with_metrics(mut self, metrics: Arc<AgentMetrics>) -> Self {
        self.metrics = metrics;
        self
    }

    pub fn woken_by(mut self, wake: Arc<Notify>) -> Self {
        self.wake = wake;
        self
    }

    pub async fn run(mut self) {
        let api: Api<Node> = Api::all(self.client.clone());
        let config =
            watcher::Config::default().fields(&format!("metadata.name={}", self.settings.node));
        let mut changes = watcher(api, config)
            .default_backoff()
            .applied_objects()
            .boxed();
        let mut tick = tokio::time::interval(self.settings.poll);
        let mut node: Option<Node> = None;
        let role = self.settings.role;
        info!(node = %self.settings.node, source = self.backend.source(), ?role, "serving the node");
        loop {
            self.metrics.beat(None);
            tokio::select! {
                next = changes.try_next() => match next {
                    Ok(Some(n)) => node = Some(n),
                    Ok(None) => return,
                    Err(e) => {
                        warn!(error = %e, "watching the node; retrying");
                        continue;
                    }
                },
                _ = tick.tick() => {}
                () = self.wake.notified() => {}
                () = tokio::time::sleep(self.coalesced_for().max(self.retry_in())), if self.deferred => {}
                // The refresh goes out on time, not at the next poll after it.
                () = tokio::time::sleep(self.refresh_in()), if self.last_write.is_some() || self.retry_at.is_some() => {}
            }
            let Some(current) = &node else { continue };
            let current = current.clone();
            if role.executes() {
                self.backend.tidy(&current).await;
                if let Some(checks) = self.backend.capability_checks() {
                    self.announced
                        .announce(&self.client, &current, checks, &self.metrics.withheld)
                        .await;
                }
                if let Err(e) = self.serve_requests(&current).await {
                    // Without the journal nothing is carried out: that could repeat one.
                    error!(error = %e, "requests are not carried out");
                }
            }
            if role.reports() {
                if self.backend.stand_aside().await {
                    // The executor's reset holds the GPUs: busy, not stuck.
                    self.metrics.beat(Some(REQUEST_MAY_TAKE));
                    continue;
                }
                self.publish(&current).await;
            }
        }
    }

    fn requests(node: &Node) -> Vec<Request> {
        let annotations = node.annotations();
        let mut out = Vec::new();
        if let Some(raw) = annotations.get(RESET_REQUEST_ANNOTATION) {
            match ResetRequest::parse(raw) {
                Ok(r) => out.push(Request {
                    id: r.id,
                    requested_at: r.requested_at.0,
                    kind: Kind::Reset { gpus: r.gpus },
                }),
                Err(e) => warn!(error = %e, "ignoring a malformed reset request"),
            }
        }
        if let Some(raw) = annotations.get(REBOOT_REQUEST_ANNOTATION) {
            match RebootRequest::parse(raw) {
                Ok(r) => out.push(Request {
                    id: r.id,
                    requested_at: r.requested_at.0,
                    kind: Kind::Reboot,
                }),
                Err(e) => warn!(error = %e, "ignoring a malformed reboot request"),
            }
        }
        // Last, so that in a tie it follows the rung it checks.
        if let Some(raw) = annotations.get(DIAGNOSTICS_REQUEST_ANNOTATION) {
            match DiagnosticsRequest::parse(raw) {
                Ok(r) => out.push(Request {
                    id: r.id,
                    requested_at: r.requested_at.0,
                    kind: Kind::Diagnostics {
                        gpus: r.gpus,
                        level: r.level,
                        timeout: r.timeout,
                    },
                }),
                Err(e) => warn!(error = %e, "ignoring a malformed diagnostics request"),
            }
        }
        // Oldest first (a stable sort), so the newest request's result is
        // the one left standing.
        out.sort_by_key(|r| r.requested_at);
        out
    }

    async fn serve_requests(&mut self, node: &Node) -> Result<(), JournalError> {
        let Some(mut journal) = self.journal.take() else {
            error!("this part carries out no requests: it has no journal");
            return Ok(());
        };
        let served = self.serve_requests_with(&mut journal, node).await;
        self.journal = Some(journal);
        served
    }

    async fn serve_requests_with(
        &mut self,
        journal: &mut Journal,
        node: &Node,
    ) -> Result<(), JournalError> {
        let mut result = node
            .annotations()
            .get(REQUEST_RESULT_ANNOTATION)
            .and_then(|v| RequestResult::parse(v).ok());
        let requests = Self::requests(node);
        for request in &requests {
            let id = request.id.to_string();
            if result.as_ref().is_some_and(|r| r.id == request.id) {
                continue;
            }
            // A request made after this one and answered supersedes it:
            // never carry it out late. Times are to the second, so one made
            // in the same second is not newer (a new incident's reset can
            // follow the last one's failed reboot within the second: it was
            // left undone, found by the chaos runs).
            let answered_at = result
                .as_ref()
                .and_then(|r| requests.iter().find(|q| q.id == r.id))
                .map(|q| q.requested_at);
            if answered_at.is_some_and(|t| t > request.requested_at) {
                continue;
            }
            let answer = match journal.seen(&id) {
                // Done before: its answer is written again, unless the node
                // shows the answer to a request as new, which it must not
                // overwrite.
                Seen::Finished(_) if answered_at.is_some_and(|t| t >= request.requested_at) => {
                    continue;
                }
                Seen::Finished(r) => r,
                Seen::Interrupted => {
                    let r = journal::interrupted(&request.id, Time(Timestamp::now()));
                    journal.finish(&r)?;
                    r
                }
                Seen::New if self.is_the_operators(node, request).await => {
                    self.carry_out(journal, node, request).await?
                }
                Seen::New => continue,
            };
            self.write_result(&answer).await;
            result = Some(answer);
        }
        Ok(())
    }

    /// Whether `request` is the one the node's `GpuNodeHealth` records in
    /// flight, on a node cordoned for it (see `authority`). A refusal is
    /// logged, counted and put on the Node's Events once; a failed read of
    /// the record is neither, and is tried again on the next round.
    async fn is_the_operators(&mut self, node: &Node, request: &Request) -> bool {
        let id = request.id.to_string();
        let said = self.refused.get(&id).copied();
        if said.is_some_and(|at| at.elapsed() < RECHECK_REFUSED) {
            return false;
        }
        let records: Api<GpuNodeHealth> = Api::all(self.client.clone());
        let health = match records.get_opt(&self.settings.node).await {
            Ok(h) => h.and_then(|h| h.status),
            Err(e) => {
                warn!(request = %id, error = %e, "reading the node's GpuNodeHealth; not carried out yet");
                return false;
            }
        };
        let asked = match &request.kind {
            Kind::Reset { gpus } => Asked::Reset { gpus },
            Kind::Reboot => Asked::Reboot,
            Kind::Diagnostics { gpus, .. } => Asked::Diagnostics { gpus },
        };
        let Err(refusal) = authority::check(&request.id, asked, node, health.as_ref()) else {
            return true;
        };
        self.refused.insert(id.clone(), Instant::now());
        if said.is_some() {
            return false;
        }
        let message = refusal.message(&request.id);
        warn!(request = %id, reason = refusal.reason(), "{message}");
        self.metrics
            .refused
            .get_or_create(&RefusalLabels {
                kind: request.kind().into(),
                reason: refusal.reason().into(),
            })
            .inc();
        // An Event of its own for each request (a recorder would fold a
        // second refusal into the first's series, and its words with it).
        let event = refusal_event(node, &id, &self.settings.node, message);
        let events: Api<events::Event> = Api::namespaced(self.client.clone(), "default");
        match events.create(&crate::post_params(), &event).await {
            // Said before this process started.
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => warn!(error = %e, "could not publish the refusal's Event"),
        }
        false
    }

    async fn carry_out(
        &mut self,
        journal: &mut Journal,
        node: &Node,
        request: &Request,
    ) -> Result<RequestResult, JournalError> {
        let id = request.id.to_string();
        let age = Timestamp::now().duration_since(request.requested_at);
        let max_age =
            SignedDuration::try_from(self.settings.request_max_age).unwrap_or(SignedDuration::MAX);
        let (outcome, message, diagnostics) = if age > max_age {
            (
                Outcome::Refused,
                format!(
                    "not carried out: requested at {}, longer ago than --request-max-age",
                    request.requested_at
                ),
                None,
            )
        } else {
            journal.begin(&id)?;
            self.crash_if(CrashPoint::Begun);
            info!(request = %id, kind = request.kind(), "carrying out");
            // A reset waits for holders to let go and for the kubelet, a
            // diagnostic for dcgmi: the loop is busy, not stuck, meanwhile.
            self.metrics.beat(Some(request.may_take()));
            match &request.kind {
                Kind::Reset { gpus } => {
                    let (outcome, message) = self.backend.reset(node, &id, gpus).await;
                    (outcome, message, None)
                }
                Kind::Reboot => {
                    let (outcome, message) = self.backend.reboot(node, &id).await;
                    (outcome, message, None)
                }
                Kind::Diagnostics {
                    gpus,
                    level,
                    timeout,
                } => {
                    let deadline = diagnostics::deadline(request.requested_at, timeout.as_std());
                    let d = diagnostics::carry_out(
                        &mut self.backend,
                        node,
                        &self.settings.dcgm,
                        *level,
                        gpus,
                        deadline,
                    )
                    .await;
                    (d.outcome, d.message, Some(d.result))
                }
            }
        };
        self.metrics
            .requests
            .get_or_create(&RequestLabels {
                kind: request.kind().into(),
                outcome: format!("{outcome:?}"),
            })
            .inc();
        let result = RequestResult {
            id: request.id.clone(),
            outcome,
            // The contract bounds it in bytes.
            message: diagnostics::fit(&message, 1000),
            finished_at: Time(Timestamp::now()),
            diagnostics,
        };
        journal.finish(&result)?;
        self.crash_if(CrashPoint::Finished);
        info!(request = %id, outcome = ?result.outcome, detail = %result.message, "done");
        Ok(result)
    }

    fn crash_if(&self, point: CrashPoint) {
        if self.settings.crash_after == Some(point) {
            error!(?point, "GPUHEALTH_TEST_CRASH_AFTER: exiting");
            std::process::exit(3);
        }
    }

    async fn write_result(&self, result: &RequestResult) {
        let value = result.to_annotation();
        if let Err(e) = self.annotate(REQUEST_RESULT_ANNOTATION, &value).await {
            // The journal keeps it: the next pass writes it again.
            warn!(error = %e, "writing the request result; will retry");
        }
    }

    /// Sets one annotation on the agent's own Node.
    async fn annotate(&self, key: &str, value: &str) -> kube::Result<()> {
        let patch = json!({"metadata": {"annotations": {key: value}}});
        self.api()
            .patch(
                &self.settings.node,
                &crate::patch_params(),
                &Patch::Merge(patch),
            )
            .await
            .map(|_| ())
    }

    fn api(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    /// Writes the report when what it says changed, when it is due for its
    /// refresh, or when the Node shows a report this process did not write.
    async fn publish(&mut self, node: &Node) {
        let read = self.backend.read(node).await;
        self.metrics
            .reads
            .get_or_create(&ResultLabels {
                result: if read.is_ok() { "ok" } else { "error" }.into(),
            })
            .inc();
        let (gpus, unreadable) = match read {
            Ok(gpus) => {
                self.metrics.set_gpus(gpus.iter().map(|g| g.health));
                (gpus, None)
            }
            Err(e) => {
                warn!(error = %e, "reading the GPUs");
                // The last GPUs read stand, marked as no longer read.
                let last = self.published.as_ref().map(|r| r.gpus.clone());
                (last.unwrap_or_default(), Some(e))
            }
        };
        self.metrics.set_readiness(match &unreadable {
            None => Ok(()),
            Some(e) => Err(format!("the GPUs cannot be read: {e}")),
        });
        // To the second, as the Node stores it: a report read back from the
        // Node is recognised by it.
        let now = Timestamp::now();
        let report = GpuReport {
            version: GpuReport::VERSION,
            observed_at: Time(Timestamp::from_second(now.as_second()).unwrap_or(now)),
            source: Some(self.backend.source().into()),
            capabilities: Some(self.backend.capabilities(node)),
            unreadable: unreadable.map(|e| e.chars().take(500).collect()),
            gpus,
        };
        let says_the_same = |r: &GpuReport| {
            r.gpus == report.gpus
                && r.source == report.source
                && r.capabilities == report.capabilities
                && r.unreadable == report.unreadable
        };
        let on_node = node
            .annotations()
            .get(GPU_REPORT_ANNOTATION)
            .and_then(|v| GpuReport::parse(v).ok());
        // Once the watch has shown the last report written, any other report
        // there is someone else's, to be put back; before, it is an older
        // state of the Node.
        let ours = |r: &GpuReport| {
            self.published
                .as_ref()
                .is_some_and(|p| p.observed_at == r.observed_at && says_the_same(r))
        };
        let latest_shown = on_node.as_ref().is_some_and(ours);
        self.caught_up |= latest_shown;
        let overwritten = self.caught_up && !latest_shown;
        let changed = self.published.as_ref().is_none_or(|p| !says_the_same(p));
        let refresh_due = self
            .last_write
            .is_none_or(|t| t.elapsed() >= self.settings.refresh);
        if !changed && !overwritten && !refresh_due {
            self.publish_condition(&report, false).await;
            return;
        }
        if overwritten && !changed {
            warn!("the GPU report on the Node is not this agent's; putting it back");
        }
        // GPUs that are bad, or that name an Xid: an Xid alone leaves a GPU
        // healthy as NVML reads it (its class is the operator's to judge),
        // and waiting out the coalescing added up to a second to the time
        // from the Xid to the cordon (the benchmark's detection figure).
        let flagged = |g: &[GpuEntry]| -> std::collections::BTreeSet<String> {
            g.iter()
                .filter(|g| g.health != GpuHealth::Healthy || !g.xids.is_empty())
                .map(|g| g.uuid.clone())
                .collect()
        };
        let newly_flagged = self
            .published
            .as_ref()
            .is_none_or(|p| !flagged(&report.gpus).is_subset(&flagged(&p.gpus)));
        if !newly_flagged && !self.coalesced_for().is_zero() {
            self.deferred = true;
            return;
        }
        if let Err(e) = report.check() {
            warn!(error = %e, "the GPUs read would make an invalid report; not published");
            return;
        }
        if let Err(e) = self
            .annotate(GPU_REPORT_ANNOTATION, &report.to_annotation())
            .await
        {
            self.write_failures = self.write_failures.saturating_add(1);
            let delay = retry_delay(self.write_failures);
            self.retry_at = Some(std::time::Instant::now() + delay);
            warn!(error = %e, retry_in = ?delay, "publishing the GPU report; will retry");
            return;
        }
        self.write_failures = 0;
        self.retry_at = None;
        if changed {
            info!(
                bad = report.bad_gpus().count(),
                unreadable = report.unreadable.is_some(),
                "published the GPU report"
            );
        }
        self.metrics.report_writes.inc();
        self.caught_up = false;
        self.last_write = Some(std::time::Instant::now());
        self.deferred = false;
        self.publish_condition(&report, refresh_due).await;
        self.published = Some(report);
    }

    /// How long until the report is due for its refresh.
    fn refresh_in(&self) -> Duration {
        let due = self.last_write.map_or(Duration::ZERO, |t| {
            self.settings.refresh.saturating_sub(t.elapsed())
        });
        due.max(self.retry_in())
    }

    /// How long until a failed report write may be tried again.
    fn retry_in(&self) -> Duration {
        self.retry_at.map_or(Duration::ZERO, |t| {
            t.saturating_duration_since(std::time::Instant::now())
        })
    }

    /// How long a report change that is no change of health must still wait.
    fn coalesced_for(&self) -> Duration {
        self.last_write
            .map_or(Duration::ZERO, |t| COALESCE.saturating_sub(t.elapsed()))
    }

    /// Writes the `GpuHealthy` condition when its status changed, when its
    /// heartbeat is due, or with the report's refresh (`refresh`).
    async fn publish_condition(&mut self, report: &GpuReport, refresh: bool) {
        let (status, reason, message) = if let Some(why) = &report.unreadable {
            (
                "Unknown",
                "GpusUnreadable",
                format!("the agent cannot read the GPUs: {why}"),
            )
        } else if report.bad_gpus().next().is_none() {
            (
                "True",
                "GpusHealthy",
                format!("{} GPU(s) healthy", report.gpus.len()),
            )
        } else {
            let bad: Vec<String> = report
                .bad_gpus()
                .map(|g| format!("GPU {} ({}) {:?}", g.index, g.uuid, g.health))
                .collect();
            ("False", "GpuUnhealthy", bad.join("; "))
        };
        let now = Timestamp::now();
        let due = match self.condition {
            Some((was, at)) => {
                was != status
                    || refresh
                    || now.duration_since(at)
                        >= SignedDuration::try_from(self.settings.refresh)
                            .unwrap_or(SignedDuration::MAX)
            }
            None => true,
        };
        if !due {
            return;
        }
        let transition = match self.condition {
            Some((was, _)) if was == status => None,
            _ => Some(Time(now)),
        };
        let mut condition = json!({
            "type": GPU_HEALTHY_CONDITION,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": Time(now),
        });
        if let Some(t) = transition {
            condition["lastTransitionTime"] = json!(t);
        }
        let patch = json!({"status": {"conditions": [condition]}});
        match self
            .api()
            .patch_status(
                &self.settings.node,
                &crate::patch_params(),
                &Patch::Strategic(patch),
            )
            .await
        {
            Ok(_) => self.condition = Some((status, now)),
            Err(e) => warn!(error = %e, "writing the GpuHealthy condition; will retry"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_report_writes_back_off_to_thirty_seconds() {
        let delays: Vec<u128> = (1..=9).map(|n| retry_delay(n).as_millis()).collect();
        assert_eq!(
            delays,
            [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]
        );
    }
}
