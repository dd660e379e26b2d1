//! Durations as users write them in a policy: Go's `time.ParseDuration` form
//! (`90s`, `10m`, `1h30m`), the same as `metav1.Duration`.
//!
//! Our own type rather than `kube::core::Duration`, whose parser goes through
//! `f64` and panics on values such as `1e400h`; this one uses integers, refuses
//! negative and absurd values with a typed error, and never panics.

use std::{fmt, str::FromStr, time};

use crate::string_form::string_form;

/// The longest duration any policy field accepts: a year is already absurd
/// for a timeout, and the bound keeps arithmetic on deadlines overflow-free.
pub const MAX: time::Duration = time::Duration::from_secs(366 * 24 * 3600);

/// The pattern the CRD schema enforces, so that the API server refuses a
/// malformed duration before any controller sees it.
pub const PATTERN: &str = r"^(0|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$";

/// A non-negative duration in Go's notation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Duration(time::Duration);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("empty duration")]
    Empty,
    #[error("negative durations are not allowed: {0:?}")]
    Negative(String),
    #[error("missing unit in {0:?} (use ns, us, ms, s, m or h)")]
    MissingUnit(String),
    #[error("unknown unit {unit:?} in {input:?} (use ns, us, ms, s, m or h)")]
    UnknownUnit { unit: String, input: String },
    #[error("malformed number in {0:?}")]
    BadNumber(String),
    #[error("duration {0:?} is longer than the maximum of 366 days")]
    TooLong(String),
}

impl Duration {
    pub const ZERO: Duration = Duration(time::Duration::ZERO);

    pub const fn from_secs(secs: u64) -> Self {
        Duration(time::Duration::from_secs(secs))
    }

    pub const fn from_mins(mins: u64) -> Self {
        Duration(time::Duration::from_secs(mins * 60))
    }

    pub const fn from_hours(hours: u64) -> Self {
        Duration(time::Duration::from_secs(hours * 3600))
    }

    pub const fn as_std(self) -> time::Duration {
        self.0
    }
}

impl From<Duration> for time::Duration {
    fn from(d: Duration) -> Self {
        d.0
    }
}

impl TryFrom<time::Duration> for Duration {
    type Error = DurationError;
    fn try_from(d: time::Duration) -> Result<Self, Self::Error> {
        if d > MAX {
            return Err(DurationError::TooLong(format!("{d:?}")));
        }
        Ok(Duration(d))
    }
}

fn unit_nanos(unit: &str) -> Option<u128> {
    Some(match unit {
        "ns" => 1,
        "us" | "µs" | "μs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60 * 1_000_000_000,
        "h" => 3600 * 1_000_000_000,
        _ => return None,
    })
}

impl FromStr for Duration {
    type Err = DurationError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err_input = || input.chars().take(64).collect::<String>();
        if input.is_empty() {
            return Err(DurationError::Empty);
        }
        if input.starts_with('-') {
            return Err(DurationError::Negative(err_input()));
        }
        let s = input.strip_prefix('+').unwrap_or(input);
        if s == "0" {
            return Ok(Duration::ZERO);
        }
        let max_nanos = MAX.as_nanos();
        let mut total: u128 = 0;
        let mut rest = s;
        while !rest.is_empty() {
            let int_len = rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len());
            let (int_part, after_int) = rest.split_at(int_len);
            let (frac_part, after_num) = match after_int.strip_prefix('.') {
                Some(f) => {
                    let frac_len = f.find(|c: char| !c.is_ascii_digit()).unwrap_or(f.len());
                    f.split_at(frac_len)
                }
                None => ("", after_int),
            };
            if int_part.is_empty() && frac_part.is_empty() {
                return Err(DurationError::BadNumber(err_input()));
            }
            let unit_len = after_num
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(after_num.len());
            let (unit, next) = after_num.split_at(unit_len);
            if unit.is_empty() {
                return Err(DurationError::MissingUnit(err_input()));
            }
            let scale = unit_nanos(unit).ok_or_else(|| DurationError::UnknownUnit {
                unit: unit.chars().take(16).collect(),
                input: err_input(),
            })?;
            // Too many digits can only mean a value beyond MAX.
            if int_part.len() > 20 {
                return Err(DurationError::TooLong(err_input()));
            }
            let whole: u128 = if int_part.is_empty() {
                0
            } else {
                int_part
                    .parse()
                    .map_err(|_| DurationError::BadNumber(err_input()))?
            };
            let mut nanos = whole
                .checked_mul(scale)
                .ok_or_else(|| DurationError::TooLong(err_input()))?;
            // The fraction: only digits that can matter at nanosecond precision.
            let mut place = scale;
            for digit in frac_part.bytes().take(30) {
                place /= 10;
                nanos += u128::from(digit - b'0') * place;
            }
            total = total.saturating_add(nanos);
            if total > max_nanos {
                return Err(DurationError::TooLong(err_input()));
            }
            rest = next;
        }
        let secs = (total / 1_000_000_000) as u64;
        let sub = (total % 1_000_000_000) as u32;
        Ok(Duration(time::Duration::new(secs, sub)))
    }
}

impl fmt::Display for Duration {
    /// Writes the shortest Go form: `1h30m`, `45s`, `1.5s`, `0s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.0.as_secs();
        let nanos = self.0.subsec_nanos();
        if total == 0 && nanos == 0 {
            return f.write_str("0s");
        }
        let (h, m, s) = (total / 3600, (total % 3600) / 60, total % 60);
        if h > 0 {
            write!(f, "{h}h")?;
        }
        if m > 0 {
            write!(f, "{m}m")?;
        }
        if nanos > 0 {
            let frac = format!("{nanos:09}");
            write!(f, "{s}.{}s", frac.trim_end_matches('0'))
        } else if s > 0 {
            write!(f, "{s}s")
        } else {
            Ok(())
        }
    }
}

string_form!(Duration, "Duration", {
    "type": "string",
    "pattern": PATTERN,
    "maxLength": 64,
});

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<time::Duration, DurationError> {
        s.parse::<Duration>().map(Duration::as_std)
    }

    #[test]
    fn parses_go_forms() {
        assert_eq!(parse("0"), Ok(time::Duration::ZERO));
        assert_eq!(parse("0s"), Ok(time::Duration::ZERO));
        assert_eq!(parse("45s"), Ok(time::Duration::from_secs(45)));
        assert_eq!(parse("10m"), Ok(time::Duration::from_secs(600)));
        assert_eq!(parse("1h30m"), Ok(time::Duration::from_secs(5400)));
        assert_eq!(parse("1.5s"), Ok(time::Duration::from_millis(1500)));
        assert_eq!(parse("250ms"), Ok(time::Duration::from_millis(250)));
        assert_eq!(parse("3us"), Ok(time::Duration::from_micros(3)));
        assert_eq!(parse(".5m"), Ok(time::Duration::from_secs(30)));
    }

    #[test]
    fn refuses_malformed_and_hostile_input() {
        for bad in [
            "",
            "5",
            "m",
            "-5s",
            "5d",
            "1e400h",
            "5s5",
            "1..5s",
            "abc",
            "9999999999999999999999999h",
            "1000000h",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn display_round_trips() {
        for s in ["0s", "45s", "10m", "1h30m", "1.5s", "2h", "1h0m1s"] {
            let d: Duration = s.parse().expect("valid");
            let again: Duration = d.to_string().parse().expect("display output parses");
            assert_eq!(d, again, "{s}");
        }
        assert_eq!(Duration::from_secs(5400).to_string(), "1h30m");
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in "\\PC{0,40}") {
            let _ = s.parse::<Duration>();
        }

        #[test]
        fn display_parses_back(secs in 0u64..(366 * 24 * 3600), nanos in 0u32..1_000_000_000) {
            let d = Duration(time::Duration::new(secs, nanos));
            proptest::prop_assert_eq!(d.to_string().parse::<Duration>(), Ok(d));
        }
    }
}
