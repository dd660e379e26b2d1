//! What a scenario asks of a timeline while it runs: where a node stands
//! by what was recorded, to wait on it.

use std::collections::BTreeSet;

use gpuhealth_api::node_health::Phase;

use super::Seen;

/// How many of gpuhealth's rules for `node` are up at the end of
/// `timeline` (counting only those it saw go up).
pub fn fences_up(timeline: &[Seen], node: &str) -> usize {
    let mut up = BTreeSet::new();
    for seen in timeline {
        if let Seen::Fence {
            node: n,
            rule,
            up: is_up,
            ..
        } = seen
            && n == node
        {
            if *is_up {
                up.insert(rule);
            } else {
                up.remove(rule);
            }
        }
    }
    up.len()
}

/// Whether `node` was last seen unschedulable in `timeline`, if it was
/// seen at all.
pub fn cordoned(timeline: &[Seen], node: &str) -> Option<bool> {
    timeline.iter().rev().find_map(|s| match s {
        Seen::Cordon {
            node: n,
            unschedulable,
            ..
        } if n == node => Some(*unschedulable),
        _ => None,
    })
}

/// Whether `node` carries gpuhealth's record of a cordon, by the latest
/// observation in `timeline`.
pub fn carries_cordon_record(timeline: &[Seen], node: &str) -> Option<bool> {
    timeline.iter().rev().find_map(|s| match s {
        Seen::Cordon { node: n, ours, .. } if n == node => Some(*ours),
        _ => None,
    })
}

/// `node`'s latest phase in `timeline`, if it is there.
pub fn latest_phase(timeline: &[Seen], node: &str) -> Option<Phase> {
    timeline.iter().rev().find_map(|s| match s {
        Seen::Health { node: n, phase, .. } if n == node => Some(*phase),
        _ => None,
    })
}

/// How `node` ended in `timeline`: `Healthy` or `Failed` once it has been
/// anything else in it; `None` while it is still on its way (or was never
/// sick).
pub fn ending(timeline: &[Seen], node: &str) -> Option<Phase> {
    let mut sick = false;
    let mut last = None;
    for seen in timeline {
        if let Seen::Health { node: n, phase, .. } = seen
            && n == node
        {
            sick |= *phase != Phase::Healthy;
            last = Some(*phase);
        }
    }
    last.filter(|p| sick && matches!(p, Phase::Healthy | Phase::Failed))
}

/// Whether pod `pod` (`namespace/name`) was last seen up in `timeline`.
pub fn pod_up(timeline: &[Seen], pod: &str) -> bool {
    timeline
        .iter()
        .rev()
        .find_map(|s| match s {
            Seen::PodUp { pod: p, .. } if p == pod => Some(true),
            Seen::PodGone { pod: p, .. } if p == pod => Some(false),
            _ => None,
        })
        .unwrap_or(false)
}
