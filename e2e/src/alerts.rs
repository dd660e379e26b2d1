//! The alerts of `config/monitoring/alerts.yaml` evaluated on a scrape of
//! `/metrics`, so that a test shows an alert's expression holds (or not)
//! for what it set up, without a Prometheus: only the one shape the
//! per-policy alerts take is read, and anything else is refused loudly.

use std::collections::BTreeMap;

/// The groups (by their labels) for which an alert's expression holds on
/// one scrape. Only the shape `AGG by (LABELS) (METRIC{MATCHERS}) > N` is
/// read (`sum` or `max`, `=` matchers), and any other panics: an alert
/// rewritten past it fails here rather than passing unevaluated.
pub fn firing(expr: &str, exposition: &str) -> Vec<BTreeMap<String, String>> {
    fn unreadable<T>(expr: &str) -> T {
        panic!("an expression this test cannot evaluate: {expr}")
    }
    let (agg, rest) = expr
        .trim()
        .split_once(" by (")
        .unwrap_or_else(|| unreadable(expr));
    let (by, rest) = rest.split_once(") (").unwrap_or_else(|| unreadable(expr));
    let (selector, threshold) = rest.rsplit_once(") > ").unwrap_or_else(|| unreadable(expr));
    let threshold: f64 = threshold
        .trim()
        .parse()
        .unwrap_or_else(|_| unreadable(expr));
    let (metric, matchers) = match selector.split_once('{') {
        Some((m, rest)) => (
            m,
            rest.strip_suffix('}').unwrap_or_else(|| unreadable(expr)),
        ),
        None => (selector, ""),
    };
    let labels_of = |inner: &str| -> BTreeMap<String, String> {
        inner
            .split(',')
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or_else(|| unreadable(expr));
                (k.trim().to_owned(), v.trim().trim_matches('"').to_owned())
            })
            .collect()
    };
    let wanted = labels_of(matchers);
    let by: Vec<&str> = by.split(',').map(str::trim).collect();
    let mut groups: BTreeMap<BTreeMap<String, String>, f64> = BTreeMap::new();
    for line in exposition.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, labels_of(rest.trim_end_matches('}'))),
            None => (series, BTreeMap::new()),
        };
        if name != metric || wanted.iter().any(|(k, v)| labels.get(k) != Some(v)) {
            continue;
        }
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let group = by
            .iter()
            .map(|k| ((*k).to_owned(), labels.get(*k).cloned().unwrap_or_default()))
            .collect();
        let total = groups.entry(group).or_insert(match agg {
            "sum" => 0.0,
            "max" => f64::MIN,
            _ => unreadable(expr),
        });
        *total = if agg == "sum" {
            *total + value
        } else {
            total.max(value)
        };
    }
    groups
        .into_iter()
        .filter(|(_, v)| *v > threshold)
        .map(|(g, _)| g)
        .collect()
}

/// The expression of alert `name` in config/monitoring/alerts.yaml.
pub fn alert_expr(name: &str) -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/monitoring/alerts.yaml"
    );
    let rule: serde_json::Value =
        serde_yaml::from_str(&std::fs::read_to_string(path).expect("alerts.yaml")).expect("YAML");
    rule["spec"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .find(|r| r["alert"] == name)
        .and_then(|r| r["expr"].as_str())
        .unwrap_or_else(|| panic!("no alert {name}"))
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = "\
# TYPE gpuhealth_nodes_not_reporting gauge
gpuhealth_nodes_not_reporting{policy=\"fleet\"} 2
gpuhealth_nodes_not_reporting{policy=\"canary\"} 0
gpuhealth_report_problems{policy=\"fleet\",problem=\"Stale\"} 1
gpuhealth_report_problems{policy=\"canary\",problem=\"Stale\"} 0
gpuhealth_report_problems{policy=\"canary\",problem=\"Unreadable\"} 3
";

    fn policies(groups: Vec<BTreeMap<String, String>>) -> Vec<String> {
        groups.into_iter().map(|g| g["policy"].clone()).collect()
    }

    #[test]
    fn an_alert_holds_for_the_groups_past_its_threshold() {
        let sum = "sum by (policy) (gpuhealth_nodes_not_reporting) > 0";
        assert_eq!(policies(firing(sum, SCRAPE)), ["fleet"]);
        let stale = "sum by (policy) (gpuhealth_report_problems{problem=\"Stale\"}) > 0";
        assert_eq!(policies(firing(stale, SCRAPE)), ["fleet"]);
        let unreadable = "max by (policy) (gpuhealth_report_problems{problem=\"Unreadable\"}) > 2";
        assert_eq!(policies(firing(unreadable, SCRAPE)), ["canary"]);
        let none = "sum by (policy) (gpuhealth_nodes_not_reporting) > 2";
        assert!(firing(none, SCRAPE).is_empty());
    }

    #[test]
    #[should_panic(expected = "cannot evaluate")]
    fn another_shape_is_refused() {
        firing("max(gpuhealth_leader) == 0", SCRAPE);
    }

    #[test]
    fn the_shipped_alert_is_read() {
        assert_eq!(
            alert_expr("GpuHealthNodeNotReporting"),
            "sum by (policy) (gpuhealth_nodes_not_reporting) > 0"
        );
    }
}
