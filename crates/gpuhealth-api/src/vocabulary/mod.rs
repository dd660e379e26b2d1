//! The words gpuhealth's status speaks in: why a node is where it is, what
//! it noticed, how an incident and each of its attempts ended. Each is a
//! type, so that the engine writes it, the operator counts it and the
//! plugin explains it without one parsing the other's text; the CRD lists
//! the same words as an enum, so the API server refuses any other.

mod attempt;
mod condition;
mod device;
mod finding;
mod outcome;
mod pod;
mod quarantine;
mod reason;

pub use attempt::{Attempt, AttemptAction, AttemptOutcome};
pub use condition::PolicyCondition;
pub use device::DeviceId;
pub use finding::{FindingKind, FindingSubject};
pub use outcome::{IncidentOutcome, WorkloadOutcome};
pub use pod::PodKey;
pub use quarantine::QuarantineWhy;
pub use reason::Reason;

/// A closed set of CamelCase words: serialised, logged and used as an
/// Event reason or metric label by the variant's own name.
macro_rules! words {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$variant_meta:meta])* $variant:ident,)+
        }
    ) => {
        $(#[$meta])*
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
            serde::Serialize, serde::Deserialize, schemars::JsonSchema,
        )]
        pub enum $name {
            $($(#[$variant_meta])* $variant,)+
        }

        impl $name {
            /// Every word, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The word as it is written in status, Events and metrics.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => stringify!($variant),)+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
pub(crate) use words;

#[cfg(test)]
mod tests {
    use super::*;

    /// The word written is the word serde writes, for every word.
    #[test]
    fn as_str_is_the_serialised_word() {
        fn check<T: serde::Serialize + Copy>(all: &[T], as_str: fn(T) -> &'static str) {
            for w in all {
                assert_eq!(
                    serde_json::to_value(w).expect("serialises"),
                    serde_json::Value::String(as_str(*w).into())
                );
            }
        }
        check(Reason::ALL, Reason::as_str);
        check(FindingKind::ALL, FindingKind::as_str);
        check(IncidentOutcome::ALL, IncidentOutcome::as_str);
        check(WorkloadOutcome::ALL, WorkloadOutcome::as_str);
        check(AttemptAction::ALL, AttemptAction::as_str);
        check(AttemptOutcome::ALL, AttemptOutcome::as_str);
    }

    /// The pattern the CRD gives each string form admits exactly what its
    /// parser reads back: every string of names and slashes up to eight
    /// characters long, so that the API server refuses all that a watch
    /// could not read, and nothing it could.
    #[test]
    fn each_string_forms_pattern_admits_exactly_what_it_reads_back() {
        fn check<T: std::str::FromStr>(pattern: &str) {
            let re = regex::Regex::new(pattern).expect("a pattern");
            let mut strings = vec![String::new()];
            for _ in 0..8 {
                let longer: Vec<String> = strings
                    .iter()
                    .filter(|s| s.len() == strings.last().map_or(0, String::len))
                    .flat_map(|s| ["a", "/"].map(|c| format!("{s}{c}")))
                    .collect();
                strings.extend(longer);
            }
            for s in &strings {
                assert_eq!(re.is_match(s), s.parse::<T>().is_ok(), "{s:?}");
            }
        }
        check::<PodKey>(pod::PATTERN);
        check::<DeviceId>(device::PATTERN);
    }
}
