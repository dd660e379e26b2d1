//! Fencing: the leader reaches the API server through a proxy, which stops
//! forwarding mid-remediation (a silent partition). The cut-off leader must
//! stop acting, and say so, before its Lease can be taken; the standby then
//! takes over and finishes. From both replicas' logs: no action attempted
//! by the old leader after it stopped, none by the new one before it led,
//! and the old leader's stop before the new one's start. The cut-off
//! replica exits (a Deployment would restart it).
//!
//! The late partition is the same, except that the proxy keeps what the
//! cut-off leader sends and delivers it once the standby has taken over
//! and acted: anything it wrote that arrived then would be a write without
//! the Lease, which the audit log shows.

use std::time::Duration;

use gpuhealth_api::node_health::Phase;
use k8s_openapi::{apimachinery::pkg::util::intstr::IntOrString, jiff::Timestamp};

use super::{Fault, Rng, Row, fleet::Fleet, policy};
use crate::{
    Result, cluster,
    invariants::Violation,
    operator::Options,
    proxy::Proxy,
    wait::{until, within},
};

const PHASES: [Phase; 2] = [Phase::Draining, Phase::Remediating];

/// How the partition treats what the cut-off leader sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Partition {
    /// Lost.
    Drops,
    /// Kept, and delivered after the standby has acted.
    DeliversLate,
}

/// How long after the standby takes over the held bytes are let through:
/// time for it to act first.
const LATE_BY: Duration = Duration::from_secs(5);

pub async fn run(trials: usize, partition: Partition, rng: &mut Rng) -> Result<Row> {
    let spec = policy(2, IntOrString::String("100%".into()));
    let group = match partition {
        Partition::Drops => "chaos-fence",
        Partition::DeliversLate => "chaos-late",
    };
    let mut fleet = Fleet::new(group, 6, spec, 1).await?;
    let proxy = Proxy::start(cluster::api_server_addr().await?).await?;
    let kubeconfig = std::env::temp_dir().join(format!("{}-via-proxy.kubeconfig", fleet.s.group));
    cluster::kubeconfig_via(proxy.addr, &kubeconfig).await?;
    let mut row = Row::new(match partition {
        Partition::Drops => "fencing: leader cut off",
        Partition::DeliversLate => "late partition: the cut-off leader's bytes delivered late",
    });
    let mut margins = Vec::new();
    for _ in 0..trials {
        // The replica behind the proxy takes over from the current leader,
        // with a direct standby beside it; any other replica (one started
        // in place of an earlier cut-off leader) would compete for the Lease.
        let previous = fleet.live_leader().await?;
        fleet.kill_all_but(&previous).await;
        let cut_off = fleet
            .start_replica_with(Options {
                kubeconfig: Some(kubeconfig.clone()),
                ..fleet.s.operator_options.clone()
            })
            .await?;
        if let Some(mut old) = fleet.remove(&previous) {
            old.kill().await;
        }
        leads(&fleet, &cut_off).await?;
        let standby = fleet.start_replica().await?;

        let faulty = 1 + rng.below(3);
        let (expect, mut violations) = fleet
            .trial(rng, faulty, &Fault::ALL, async |fleet, rng| {
                fleet.reached(PHASES[rng.below(PHASES.len())]).await?;
                tokio::time::sleep(rng.within(Duration::from_secs(1))).await;
                match partition {
                    Partition::Drops => proxy.cut(),
                    Partition::DeliversLate => proxy.hold(),
                }
                eprintln!("chaos: cut {cut_off} off the API server ({partition:?})");
                Ok(Vec::new())
            })
            .await?;
        leads(&fleet, &standby).await?;
        if partition == Partition::DeliversLate {
            tokio::time::sleep(LATE_BY).await;
        }
        let delivered_before = proxy.held.delivered();
        proxy.restore();
        let Some(mut old) = fleet.remove(&cut_off) else {
            continue;
        };
        if old.exited(Duration::from_secs(60)).await.is_err() {
            old.kill().await;
            violations.push(Violation::Missing {
                what: format!("{cut_off} kept running after it lost the Lease"),
            });
        }
        // Anything it sent that reaches the API server now, after the
        // standby acted, could be a write without the Lease: none may.
        let flushed = within(
            "the held bytes delivered or lost",
            Duration::from_secs(10),
            async {
                while proxy.held.pending() > 0 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(())
            },
        )
        .await;
        let late = proxy.held.delivered() - delivered_before;
        if let Err(e) = flushed {
            violations.push(Violation::Missing {
                what: e.to_string(),
            });
        } else if late > 0 {
            violations.push(Violation::Missing {
                what: format!(
                    "{late} bytes {cut_off} sent reached the API server after the standby took over"
                ),
            });
        }
        let new = fleet
            .replicas
            .iter()
            .find(|r| r.name == standby)
            .map(|r| r.log.clone());
        let logs = (
            std::fs::read_to_string(&old.log).unwrap_or_default(),
            new.map(std::fs::read_to_string)
                .transpose()
                .map_err(|e| crate::HarnessError::ClusterStart(e.to_string()))?
                .unwrap_or_default(),
        );
        match judge(&logs.0, &logs.1) {
            Ok(margin) => margins.push(margin),
            Err(what) => violations.push(Violation::Missing { what }),
        }
        row.add_trial(&expect, violations);
    }
    if partition == Partition::DeliversLate {
        let held = &proxy.held;
        let read = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::SeqCst);
        row.notes.push(format!(
            "the proxy held {} bytes the cut-off leader sent; {} were delivered {} s after the standby took over, {} lost when the leader reset its connections on stopping",
            read(&held.bytes),
            read(&held.delivered),
            LATE_BY.as_secs(),
            read(&held.discarded)
        ));
    }
    if let Some(least) = margins.iter().min() {
        row.notes.push(format!(
            "the cut-off leader stopped at least {:.1} s before the standby took over (lease 6 s, renew deadline 4 s)",
            least.as_secs_f64()
        ));
    }
    fleet.add_notes(&mut row);
    Ok(row)
}

/// Waits until `name` holds the Lease.
pub(super) async fn leads(fleet: &Fleet, name: &str) -> Result<()> {
    let leases = kube::Api::namespaced(fleet.s.client.clone(), "default");
    until(
        leases,
        &fleet.lease,
        super::fleet::SETTLE,
        |l: &k8s_openapi::api::coordination::v1::Lease| {
            l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some(name)
        },
    )
    .await
    .map(|_| ())
}

/// From the old leader's log and the new one's: how long before the new
/// leader took over the old one had stopped, or what overlapped.
pub fn judge(old: &str, new: &str) -> std::result::Result<Duration, String> {
    let stopped = first(old, |l| {
        l.contains("no renewal within the deadline") || l.contains("another replica took the lease")
    })
    .ok_or("the cut-off leader never said it stopped leading")?;
    let led = first(new, |l| l.contains("became the leader"))
        .ok_or("the standby never became the leader")?;
    if stopped >= led {
        return Err(format!(
            "overlap: the old leader stopped at {stopped}, the new one led from {led}"
        ));
    }
    let acting = |l: &str| l.contains("carrying out");
    if let Some(late) = last(old, acting).filter(|t| *t >= stopped) {
        return Err(format!(
            "the old leader attempted an action at {late}, after it stopped at {stopped}"
        ));
    }
    if let Some(early) = first(new, acting).filter(|t| *t < led) {
        return Err(format!(
            "the new leader attempted an action at {early}, before it led at {led}"
        ));
    }
    let margin = led.duration_since(stopped);
    Ok(Duration::try_from(margin).unwrap_or_default())
}

/// The time of a log line: its first word, as the operator's text log
/// writes it.
fn stamp(line: &str) -> Option<Timestamp> {
    line.split_whitespace().next()?.parse().ok()
}

fn first(log: &str, wanted: impl Fn(&str) -> bool) -> Option<Timestamp> {
    log.lines().filter(|l| wanted(l)).find_map(stamp)
}

fn last(log: &str, wanted: impl Fn(&str) -> bool) -> Option<Timestamp> {
    log.lines().rev().filter(|l| wanted(l)).find_map(stamp)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: &str = "\
2026-11-30T20:00:00.000000Z  INFO gpuhealth_operator::leader: became the leader lease=l
2026-11-30T20:00:05.000000Z DEBUG gpuhealth_operator::reconcile: carrying out node=n action=Cordon
2026-11-30T20:00:10.000000Z  WARN gpuhealth_operator::leader: no renewal within the deadline lease=l
";

    fn new_leader(at: &str, acts: &str) -> String {
        format!(
            "{at}  INFO gpuhealth_operator::leader: became the leader lease=l\n{acts} DEBUG gpuhealth_operator::reconcile: carrying out node=n\n"
        )
    }

    #[test]
    fn a_clean_handover_has_a_margin() {
        let new = new_leader("2026-11-30T20:00:12.000000Z", "2026-11-30T20:00:12.500000Z");
        assert_eq!(judge(OLD, &new), Ok(Duration::from_secs(2)));
    }

    #[test]
    fn overlaps_are_caught() {
        // Led before the old one stopped.
        let early = new_leader("2026-11-30T20:00:09.000000Z", "2026-11-30T20:00:09.500000Z");
        assert!(judge(OLD, &early).is_err_and(|e| e.starts_with("overlap")));
        // The old one acted after it stopped.
        let late_old = format!(
            "{OLD}2026-11-30T20:00:11.000000Z DEBUG gpuhealth_operator::reconcile: carrying out node=n\n"
        );
        let new = new_leader("2026-11-30T20:00:12.000000Z", "2026-11-30T20:00:12.500000Z");
        assert!(judge(&late_old, &new).is_err_and(|e| e.contains("after it stopped")));
        // The new one acted before it led.
        let eager = format!(
            "2026-11-30T20:00:11.000000Z DEBUG gpuhealth_operator::reconcile: carrying out node=n\n{new}"
        );
        assert!(judge(OLD, &eager).is_err_and(|e| e.contains("before it led")));
        // Silence is not a pass.
        assert!(judge("", &new).is_err());
    }
}
