//! Figures: a process's memory and CPU from /proc, API requests from its
//! `/metrics`, and percentiles.

use std::collections::BTreeMap;

use serde::Serialize;

/// `VmRSS` and `VmHWM` (the peak) of `pid`, in KiB.
pub fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// User plus system CPU time of `pid`, in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 here.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every Linux the kernel ABI allows.
    Some(ticks as f64 / 100.0)
}

/// API requests by verb and resource, summed over codes, from the
/// `family` counter (`gpuhealth_api_requests_total`) in `exposition`.
pub fn requests(exposition: &str, family: &str) -> BTreeMap<(String, String), f64> {
    counted_by(exposition, family, ["verb", "resource"])
}

/// The `family` counter in `exposition`, summed by the values of two
/// labels (a peer's client counts by `method` and `code`: no resource).
pub fn counted_by(
    exposition: &str,
    family: &str,
    [first, second]: [&str; 2],
) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix(family).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        let value: f64 = value.trim().parse().unwrap_or(0.0);
        *out.entry((label(first), label(second))).or_insert(0.0) += value;
    }
    out
}

/// Requests between two scrapes, by verb and resource.
pub fn delta(
    before: &BTreeMap<(String, String), f64>,
    after: &BTreeMap<(String, String), f64>,
    include: impl Fn(&str, &str) -> bool,
) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for ((verb, resource), n) in after {
        if !include(verb, resource) {
            continue;
        }
        let key = (verb.clone(), resource.clone());
        let was = before.get(&key).copied().unwrap_or(0.0);
        if n - was > 0.0 {
            out.insert(key, n - was);
        }
    }
    out
}

/// Requests between two scrapes, by verb.
pub fn by_verb(
    before: &BTreeMap<(String, String), f64>,
    after: &BTreeMap<(String, String), f64>,
    include: impl Fn(&str, &str) -> bool,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for ((verb, _), n) in delta(before, after, include) {
        *out.entry(verb).or_insert(0.0) += n;
    }
    out
}

/// One series of a Prometheus histogram: cumulative bucket counts by upper
/// bound, the sum and the count.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// Observations between `before` and `self`.
    pub fn since(&self, before: &Histogram) -> Histogram {
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|(le, n)| {
                    let was = before
                        .buckets
                        .iter()
                        .find(|(b, _)| b == le)
                        .map_or(0.0, |b| b.1);
                    (*le, n - was)
                })
                .collect(),
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }

    pub fn mean(&self) -> f64 {
        if self.count > 0.0 {
            self.sum / self.count
        } else {
            0.0
        }
    }

    /// The upper bound of the bucket holding quantile `q`: the quantile is
    /// at most this.
    pub fn quantile_at_most(&self, q: f64) -> f64 {
        let rank = q * self.count;
        self.buckets
            .iter()
            .find(|(_, n)| *n >= rank && *n > 0.0)
            .map_or(f64::INFINITY, |(le, _)| *le)
    }
}

/// The series of histogram `family` in `exposition`, by the value of label
/// `label`.
pub fn histograms(exposition: &str, family: &str, label: &str) -> BTreeMap<String, Histogram> {
    let mut out: BTreeMap<String, Histogram> = BTreeMap::new();
    let key = format!("{label}=\"");
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix(family) else {
            continue;
        };
        let Some((kind, rest)) = rest.split_once('{') else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let value: f64 = value.trim().parse().unwrap_or(0.0);
        let find = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(name))
                .map(|v| v.trim_end_matches('"').to_owned())
        };
        let Some(series) = find(&key) else { continue };
        let h = out.entry(series).or_default();
        match kind {
            "_bucket" => {
                let le =
                    find("le=\"").map_or(f64::INFINITY, |v| v.parse().unwrap_or(f64::INFINITY));
                h.buckets.push((le, value));
            }
            "_sum" => h.sum = value,
            "_count" => h.count = value,
            _ => {}
        }
    }
    out
}

pub const WRITES: [&str; 5] = ["create", "update", "patch", "delete", "deletecollection"];

/// Percentiles of a sample, in the sample's unit.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Distribution {
    pub n: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub min: f64,
}

impl Distribution {
    pub fn of(mut sample: Vec<f64>) -> Distribution {
        sample.sort_by(f64::total_cmp);
        let at = |q: f64| -> f64 {
            if sample.is_empty() {
                return 0.0;
            }
            // Nearest rank.
            let rank = ((q * sample.len() as f64).ceil() as usize).clamp(1, sample.len());
            sample[rank - 1]
        };
        Distribution {
            n: sample.len(),
            p50: at(0.5),
            p99: at(0.99),
            max: sample.last().copied().unwrap_or(0.0),
            min: sample.first().copied().unwrap_or(0.0),
        }
    }
}

pub fn median(sample: &[f64]) -> f64 {
    Distribution::of(sample.to_vec()).p50
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_s_client_counter_is_read_by_method() {
        let text = "rest_client_requests_total{code=\"200\",host=\"127.0.0.1:1\",method=\"GET\"} 7\n\
                    rest_client_requests_total{code=\"201\",host=\"127.0.0.1:1\",method=\"POST\"} 2\n\
                    rest_client_requests_total{code=\"404\",host=\"127.0.0.1:1\",method=\"GET\"} 1\n";
        let counted = counted_by(text, "rest_client_requests_total", ["method", "code"]);
        assert_eq!(counted.get(&("GET".into(), "200".into())), Some(&7.0));
        assert_eq!(counted.get(&("GET".into(), "404".into())), Some(&1.0));
        assert_eq!(counted.get(&("POST".into(), "201".into())), Some(&2.0));
    }

    #[test]
    fn nearest_rank_percentiles() {
        let d = Distribution::of((1..=100).map(f64::from).collect());
        assert_eq!(
            (d.p50, d.p99, d.max, d.min, d.n),
            (50.0, 99.0, 100.0, 1.0, 100)
        );
        let one = Distribution::of(vec![7.0]);
        assert_eq!((one.p50, one.p99), (7.0, 7.0));
    }

    #[test]
    fn histogram_series_are_read_by_label_and_differenced() {
        let text = |n: [u32; 3], sum: f64| {
            format!(
                "# TYPE x_seconds histogram\n\
                 x_seconds_sum{{stage=\"read\"}} {sum}\n\
                 x_seconds_count{{stage=\"read\"}} {}\n\
                 x_seconds_bucket{{le=\"0.1\",stage=\"read\"}} {}\n\
                 x_seconds_bucket{{le=\"1.0\",stage=\"read\"}} {}\n\
                 x_seconds_bucket{{le=\"+Inf\",stage=\"read\"}} {}\n\
                 x_seconds_count{{stage=\"wait\"}} 7\n",
                n[2], n[0], n[1], n[2]
            )
        };
        let before = histograms(&text([1, 1, 1], 0.05), "x_seconds", "stage");
        let after = histograms(&text([50, 99, 101], 40.05), "x_seconds", "stage");
        assert_eq!(after["wait"].count, 7.0);
        let read = after["read"].since(&before["read"]);
        assert_eq!(read.count, 100.0);
        assert!((read.mean() - 0.4).abs() < 1e-9);
        assert_eq!(read.quantile_at_most(0.5), 1.0);
        assert_eq!(read.quantile_at_most(0.49), 0.1);
        assert_eq!(read.quantile_at_most(0.98), 1.0);
        assert_eq!(read.quantile_at_most(0.99), f64::INFINITY);
    }

    #[test]
    fn requests_are_summed_over_codes_and_split_by_verb() {
        let before = requests(
            "gpuhealth_api_requests_total{verb=\"patch\",resource=\"nodes\",code=\"200\"} 2\n",
            "gpuhealth_api_requests_total",
        );
        let after = requests(
            "# TYPE gpuhealth_api_requests counter\n\
             gpuhealth_api_requests_total{verb=\"patch\",resource=\"nodes\",code=\"200\"} 5\n\
             gpuhealth_api_requests_total{verb=\"patch\",resource=\"nodes\",code=\"409\"} 1\n\
             gpuhealth_api_requests_total{verb=\"update\",resource=\"leases\",code=\"200\"} 9\n",
            "gpuhealth_api_requests_total",
        );
        let all = by_verb(&before, &after, |_, _| true);
        assert_eq!(all.get("patch"), Some(&4.0));
        assert_eq!(all.get("update"), Some(&9.0));
        let no_lease = by_verb(&before, &after, |_, r| r != "leases");
        assert_eq!(no_lease.get("update"), None);
        let by_resource = delta(&before, &after, |_, _| true);
        assert_eq!(
            by_resource.get(&("patch".into(), "nodes".into())),
            Some(&4.0)
        );
        assert_eq!(by_resource.len(), 2);
    }
}
