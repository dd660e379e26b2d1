//! Types written as one string in status and annotations: serialised by
//! their `Display`, read back by their `FromStr`, and described to the API
//! server as a string of a pattern, so that it refuses a value that would
//! not read back. One unreadable record would otherwise fail the whole list
//! a watch starts with, and every reader of the kind would wait on it.

/// `string_form!(Type, "SchemaName", { ...the JSON schema... })`.
macro_rules! string_form {
    ($type:ty, $name:literal, $schema:tt) => {
        impl serde::Serialize for $type {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $type {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let raw = <std::borrow::Cow<'_, str> as serde::Deserialize>::deserialize(d)?;
                raw.parse().map_err(serde::de::Error::custom)
            }
        }

        impl schemars::JsonSchema for $type {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                $name.into()
            }

            fn inline_schema() -> bool {
                true
            }

            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!($schema)
            }
        }
    };
}

pub(crate) use string_form;
