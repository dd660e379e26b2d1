//! What every subcommand shares: the output format, colour, and how times
//! and durations read.

use std::io::IsTerminal;

use clap::ValueEnum;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
    Yaml,
}

/// `answer` in the chosen format; `text` is only rendered when asked for.
pub fn emit<T: Serialize>(
    output: Output,
    answer: &T,
    text: impl FnOnce() -> String,
) -> Result<String, String> {
    match output {
        Output::Text => Ok(text()),
        Output::Json => serde_json::to_string_pretty(answer)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
        Output::Yaml => serde_yaml::to_string(answer).map_err(|e| e.to_string()),
    }
}

/// ANSI colour, or nothing: the renderers take a `Style` so that they stay
/// pure and their tests (and the golden file) see plain text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Style {
    pub color: bool,
}

impl Style {
    /// Colour only for a person at a terminal who has not asked for none
    /// (<https://no-color.org>: `NO_COLOR` set to anything but empty).
    pub fn for_stdout() -> Style {
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        Style {
            color: std::io::stdout().is_terminal() && !no_color,
        }
    }

    fn paint(self, code: &str, s: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_owned()
        }
    }

    pub fn bold(self, s: &str) -> String {
        self.paint("1", s)
    }
    pub fn red(self, s: &str) -> String {
        self.paint("31", s)
    }
    pub fn green(self, s: &str) -> String {
        self.paint("32", s)
    }
    pub fn yellow(self, s: &str) -> String {
        self.paint("33", s)
    }
    pub fn dim(self, s: &str) -> String {
        self.paint("2", s)
    }

    pub fn apply(self, paint: Paint, s: &str) -> String {
        match paint {
            Paint::Plain => s.to_owned(),
            Paint::Bold => self.bold(s),
            Paint::Red => self.red(s),
            Paint::Green => self.green(s),
            Paint::Yellow => self.yellow(s),
            Paint::Dim => self.dim(s),
        }
    }
}

/// How a table cell is coloured when colour is on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Paint {
    #[default]
    Plain,
    Bold,
    Red,
    Green,
    Yellow,
    Dim,
}

/// Left-aligned columns, two spaces apart, each line indented by `indent`.
/// Cells are padded before they are painted, so colour never skews the
/// alignment; the last column is not padded.
pub fn table(style: Style, indent: &str, header: &[&str], rows: &[Vec<(String, Paint)>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, (cell, _)) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<(String, Paint)>| {
        let last = cells.len().saturating_sub(1);
        let parts: Vec<String> = cells
            .into_iter()
            .enumerate()
            .map(|(i, (cell, paint))| {
                let width = widths.get(i).copied().unwrap_or(0);
                let padded = if i == last {
                    cell
                } else {
                    format!("{cell:<width$}")
                };
                style.apply(paint, &padded)
            })
            .collect();
        format!("{indent}{}\n", parts.join("  ").trim_end())
    };
    let mut out = line(
        header
            .iter()
            .map(|h| ((*h).to_owned(), Paint::Dim))
            .collect(),
    );
    for row in rows {
        out.push_str(&line(row.clone()));
    }
    out
}

/// A time as RFC 3339, to the second: sub-second digits only add noise to
/// a story told in seconds.
pub fn rfc3339(t: Timestamp) -> String {
    Timestamp::from_second(t.as_second())
        .unwrap_or(t)
        .to_string()
}

/// A duration in its two largest units: `0s`, `58s`, `5m27s`, `2h5m`, `3d4h`.
pub fn duration(d: SignedDuration) -> String {
    let secs = d.as_secs().unsigned_abs();
    let sign = if d.is_negative() { "-" } else { "" };
    let (days, hours, mins, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let text = if days > 0 {
        format!("{days}d{hours}h")
    } else if hours > 0 {
        format!("{hours}h{mins}m")
    } else if mins > 0 {
        format!("{mins}m{s}s")
    } else {
        format!("{s}s")
    };
    format!("{sign}{text}")
}

/// How long ago `t` was, as `5m27s ago` (`in 3m` for a time still ahead).
pub fn ago(now: Timestamp, t: Timestamp) -> String {
    let d = now.duration_since(t);
    if d.is_negative() {
        format!("in {}", duration(-d))
    } else {
        format!("{} ago", duration(d))
    }
}

/// `t` relative to `origin`, signed: `+0s`, `+58s`, `-2h5m`.
pub fn offset(origin: Timestamp, t: Timestamp) -> String {
    let d = t.duration_since(origin);
    if d.is_negative() {
        duration(d)
    } else {
        format!("+{}", duration(d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    #[test]
    fn durations_read_in_their_two_largest_units() {
        let s = SignedDuration::from_secs;
        assert_eq!(duration(s(0)), "0s");
        assert_eq!(duration(s(58)), "58s");
        assert_eq!(duration(s(327)), "5m27s");
        assert_eq!(duration(s(7_530)), "2h5m");
        assert_eq!(duration(s(273_600)), "3d4h");
        assert_eq!(duration(s(-61)), "-1m1s");
    }

    #[test]
    fn offsets_are_signed_and_ages_say_which_way() {
        let origin = t("2026-05-29T08:15:40Z");
        assert_eq!(offset(origin, origin), "+0s");
        assert_eq!(offset(origin, t("2026-05-29T08:16:38Z")), "+58s");
        assert_eq!(offset(origin, t("2026-05-29T08:15:00Z")), "-40s");
        assert_eq!(ago(t("2026-05-29T08:20:00Z"), origin), "4m20s ago");
        assert_eq!(ago(origin, t("2026-05-29T08:18:40Z")), "in 3m0s");
    }

    #[test]
    fn times_drop_their_fraction_and_colour_is_off_unless_asked() {
        assert_eq!(
            rfc3339(t("2026-05-29T08:15:40.123456Z")),
            "2026-05-29T08:15:40Z"
        );
        assert_eq!(Style::default().red("Failed"), "Failed");
        assert_eq!(Style { color: true }.red("Failed"), "\x1b[31mFailed\x1b[0m");
    }

    #[test]
    fn tables_align_on_the_text_not_the_colour() {
        let rows = vec![
            vec![
                ("node-a".into(), Paint::Plain),
                ("Failed".into(), Paint::Red),
            ],
            vec![
                ("n".into(), Paint::Plain),
                ("Draining".into(), Paint::Yellow),
            ],
        ];
        let plain = table(Style::default(), "  ", &["NODE", "PHASE"], &rows);
        assert_eq!(
            plain,
            "  NODE    PHASE\n  node-a  Failed\n  n       Draining\n"
        );
        let coloured = table(Style { color: true }, "  ", &["NODE", "PHASE"], &rows);
        assert!(
            coloured.contains("n       \x1b[33mDraining"),
            "{coloured:?}"
        );
    }

    #[test]
    fn the_formats_serialise_the_answer_and_text_renders_only_when_asked() {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct A {
            bad_gpus: u32,
        }
        let a = A { bad_gpus: 1 };
        let json = emit(Output::Json, &a, || unreachable!()).expect("json");
        assert_eq!(json, "{\n  \"badGpus\": 1\n}\n");
        let yaml = emit(Output::Yaml, &a, || unreachable!()).expect("yaml");
        assert_eq!(yaml, "badGpus: 1\n");
        assert_eq!(
            emit(Output::Text, &a, || "one".into()).expect("text"),
            "one"
        );
    }
}
