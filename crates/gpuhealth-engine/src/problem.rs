//! One field of a policy the operator cannot honour as written.

use std::fmt;

/// One field the operator cannot honour.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Its path from the object: `spec.maintenanceWindows[1].timeZone`.
    pub field: String,
    /// What is wrong, and what follows from it.
    pub message: String,
}

impl Problem {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Problem {
        Problem {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}
