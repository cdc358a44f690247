//! Records: named fields in one contiguous buffer.
//!
//! A record is what YCSB calls a row: a set of fields, each a name and a
//! byte value (YCSB's workload A stores 10 fields of 100 bytes under one
//! key). The store keeps a record as the single buffer it arrived in, so a
//! record costs one allocation however many fields it has, and a `get`
//! sends that buffer back as it is.
//!
//! Encoding (little endian):
//!
//! ```text
//! record := count:u16 field*count
//! field  := name_len:u8 name:[u8; name_len] (UTF-8)
//!           value_len:u32 value:[u8; value_len]
//! ```
//!
//! Field names are unique within a record. [`Record::from_bytes`] checks all
//! of this, so a record from the network is either well formed or refused.

use std::fmt;

/// Most fields one record may have.
pub const MAX_FIELDS: usize = 4096;

/// Longest field name in bytes.
pub const MAX_NAME: usize = 255;

/// Why bytes are not a well-formed record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed record: {0}")]
pub struct RecordError(pub String);

fn bad(why: impl Into<String>) -> RecordError {
    RecordError(why.into())
}

/// A record: validated encoded bytes (see the module documentation).
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Record {
    bytes: Vec<u8>,
}

impl Record {
    /// A record with no fields.
    pub fn empty() -> Self {
        Self::builder().build()
    }

    /// A builder adding fields one by one.
    pub fn builder() -> RecordBuilder {
        RecordBuilder {
            bytes: vec![0, 0],
            count: 0,
        }
    }

    /// A record of `fields` (name, value).
    ///
    /// Panics on a name longer than [`MAX_NAME`] bytes, a value of 4 GiB or
    /// more, more than [`MAX_FIELDS`] fields or a repeated name: those are
    /// programming errors, not data errors. [`Record::try_from_fields`]
    /// returns them as errors instead.
    pub fn from_fields<N, V>(fields: impl IntoIterator<Item = (N, V)>) -> Self
    where
        N: AsRef<str>,
        V: AsRef<[u8]>,
    {
        Self::try_from_fields(fields).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Record::from_fields`] returning an error instead of panicking.
    pub fn try_from_fields<N, V>(
        fields: impl IntoIterator<Item = (N, V)>,
    ) -> Result<Self, RecordError>
    where
        N: AsRef<str>,
        V: AsRef<[u8]>,
    {
        let mut b = Self::builder();
        for (n, v) in fields {
            b.try_field(n.as_ref(), v.as_ref())?;
        }
        let r = b.build();
        r.check_unique()?;
        Ok(r)
    }

    /// A record with one field named `""` holding `value` (a plain value
    /// store, as memcached's items).
    pub fn value(value: &[u8]) -> Self {
        Self::from_fields([("", value)])
    }

    /// Checks `bytes` and takes them as a record.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, RecordError> {
        let r = Self { bytes };
        r.validate()?;
        Ok(r)
    }

    /// The encoded bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The encoded bytes, taken.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// Encoded size in bytes.
    pub fn encoded_len(&self) -> usize {
        self.bytes.len()
    }

    /// Number of fields.
    pub fn len(&self) -> usize {
        u16::from_le_bytes([self.bytes[0], self.bytes[1]]) as usize
    }

    /// True if the record has no fields.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The fields in their stored order.
    pub fn fields(&self) -> Fields<'_> {
        Fields {
            rest: &self.bytes[2..],
            left: self.len(),
        }
    }

    /// The value of field `name`.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// The value of the field named `""` (see [`Record::value`]).
    pub fn plain_value(&self) -> Option<&[u8]> {
        self.field("")
    }

    /// A record of only the fields named in `names` (in this record's order;
    /// names it lacks are left out).
    pub fn select<S: AsRef<str>>(&self, names: &[S]) -> Record {
        let mut b = Self::builder();
        for (n, v) in self.fields() {
            if names.iter().any(|s| s.as_ref() == n) {
                b.push_unchecked(n, v);
            }
        }
        b.build()
    }

    /// This record with `update`'s fields: a field of the same name is
    /// replaced, new ones are appended.
    pub fn merged(&self, update: &Record) -> Record {
        let mut b = Self::builder();
        b.bytes
            .reserve(self.bytes.len() + update.bytes.len().saturating_sub(2));
        for (n, v) in self.fields() {
            let v = update.field(n).unwrap_or(v);
            b.push_unchecked(n, v);
        }
        for (n, v) in update.fields() {
            if self.field(n).is_none() {
                b.push_unchecked(n, v);
            }
        }
        b.build()
    }

    fn validate(&self) -> Result<(), RecordError> {
        let b = &self.bytes;
        if b.len() < 2 {
            return Err(bad("shorter than its field count"));
        }
        let count = u16::from_le_bytes([b[0], b[1]]) as usize;
        if count > MAX_FIELDS {
            return Err(bad(format!("{count} fields (at most {MAX_FIELDS})")));
        }
        let mut at = 2;
        for i in 0..count {
            let Some(&nl) = b.get(at) else {
                return Err(bad(format!("field {i}: name length missing")));
            };
            let name_end = at + 1 + nl as usize;
            let name = b
                .get(at + 1..name_end)
                .ok_or_else(|| bad(format!("field {i}: name runs past the end")))?;
            std::str::from_utf8(name).map_err(|_| bad(format!("field {i}: name is not UTF-8")))?;
            let len = b
                .get(name_end..name_end + 4)
                .ok_or_else(|| bad(format!("field {i}: value length missing")))?;
            let vl = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
            let end = (name_end + 4)
                .checked_add(vl)
                .filter(|&e| e <= b.len())
                .ok_or_else(|| bad(format!("field {i}: value of {vl} bytes runs past the end")))?;
            at = end;
        }
        if at != b.len() {
            return Err(bad(format!("{} bytes after the last field", b.len() - at)));
        }
        self.check_unique()
    }

    fn check_unique(&self) -> Result<(), RecordError> {
        // Records have few fields: quadratic is cheaper than a set here.
        let names: Vec<&str> = self.fields().map(|(n, _)| n).collect();
        for (i, n) in names.iter().enumerate() {
            if names[..i].contains(n) {
                return Err(bad(format!("field name {n:?} repeated")));
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        for (n, v) in self.fields() {
            match std::str::from_utf8(v) {
                Ok(s) if v.len() <= 64 => m.entry(&n, &s),
                _ => m.entry(&n, &format_args!("<{} bytes>", v.len())),
            };
        }
        m.finish()
    }
}

/// Iterator over a record's (name, value) fields.
pub struct Fields<'a> {
    rest: &'a [u8],
    left: usize,
}

impl<'a> Iterator for Fields<'a> {
    type Item = (&'a str, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // The bytes were validated when the record was made.
        let nl = self.rest[0] as usize;
        let name = std::str::from_utf8(&self.rest[1..1 + nl]).expect("validated");
        let at = 1 + nl;
        let vl = u32::from_le_bytes(self.rest[at..at + 4].try_into().expect("4 bytes")) as usize;
        let value = &self.rest[at + 4..at + 4 + vl];
        self.rest = &self.rest[at + 4 + vl..];
        Some((name, value))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

/// Builds a [`Record`] field by field.
pub struct RecordBuilder {
    bytes: Vec<u8>,
    count: usize,
}

impl RecordBuilder {
    /// Adds a field (see [`Record::from_fields`] for what panics).
    pub fn field(mut self, name: &str, value: &[u8]) -> Self {
        self.try_field(name, value)
            .unwrap_or_else(|e| panic!("{e}"));
        self
    }

    fn try_field(&mut self, name: &str, value: &[u8]) -> Result<(), RecordError> {
        if name.len() > MAX_NAME {
            return Err(bad(format!(
                "field name of {} bytes (at most {MAX_NAME})",
                name.len()
            )));
        }
        if u32::try_from(value.len()).is_err() {
            return Err(bad("a field value of 4 GiB or more"));
        }
        if self.count == MAX_FIELDS {
            return Err(bad(format!("more than {MAX_FIELDS} fields")));
        }
        self.push_unchecked(name, value);
        Ok(())
    }

    fn push_unchecked(&mut self, name: &str, value: &[u8]) {
        self.bytes.push(name.len() as u8);
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes
            .extend_from_slice(&(value.len() as u32).to_le_bytes());
        self.bytes.extend_from_slice(value);
        self.count += 1;
    }

    /// The record.
    pub fn build(mut self) -> Record {
        self.bytes[..2].copy_from_slice(&(self.count as u16).to_le_bytes());
        Record { bytes: self.bytes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_select_and_merge() {
        let r = Record::from_fields([("a", &b"1"[..]), ("bb", b""), ("", b"xyz")]);
        assert_eq!(r.len(), 3);
        let back = Record::from_bytes(r.as_bytes().to_vec()).unwrap();
        assert_eq!(back, r);
        assert_eq!(r.field("bb"), Some(&b""[..]));
        assert_eq!(r.plain_value(), Some(&b"xyz"[..]));
        assert_eq!(r.field("c"), None);
        let s = r.select(&["", "a", "zz"]);
        assert_eq!(
            s.fields().collect::<Vec<_>>(),
            vec![("a", &b"1"[..]), ("", &b"xyz"[..])]
        );
        let m = r.merged(&Record::from_fields([("bb", &b"new"[..]), ("c", b"3")]));
        assert_eq!(
            m.fields().collect::<Vec<_>>(),
            vec![
                ("a", &b"1"[..]),
                ("bb", &b"new"[..]),
                ("", &b"xyz"[..]),
                ("c", &b"3"[..])
            ]
        );
    }

    #[test]
    fn malformed_bytes_are_refused_with_the_reason() {
        let good = Record::from_fields([("name", &b"value"[..])]).into_bytes();
        assert!(Record::from_bytes(vec![]).is_err());
        // Every truncation is refused.
        for cut in 0..good.len() {
            let e = Record::from_bytes(good[..cut].to_vec()).unwrap_err();
            assert!(e.0.contains("field 0") || e.0.contains("shorter"), "{e}");
        }
        let mut extra = good.clone();
        extra.push(0);
        assert!(Record::from_bytes(extra).unwrap_err().0.contains("after"));
        let mut huge = good.clone();
        huge[2 + 1 + 4..2 + 1 + 4 + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Record::from_bytes(huge)
            .unwrap_err()
            .0
            .contains("past the end"));
        let mut not_utf8 = good.clone();
        not_utf8[3] = 0xff;
        assert!(Record::from_bytes(not_utf8)
            .unwrap_err()
            .0
            .contains("UTF-8"));
        let dup = Record::builder().field("x", b"1").field("x", b"2").build();
        assert!(Record::from_bytes(dup.into_bytes())
            .unwrap_err()
            .0
            .contains("repeated"));
        assert!(Record::try_from_fields([("x", b"1"), ("x", b"2")]).is_err());
        let too_many = [0xff, 0xff];
        assert!(Record::from_bytes(too_many.to_vec())
            .unwrap_err()
            .0
            .contains("fields"));
    }
}
