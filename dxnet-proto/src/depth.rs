//! A nesting-depth limit for serde deserialization.
//!
//! Derived `Deserialize` impls recurse once per level of nesting, so a
//! hostile payload for a recursive type (`enum Tree { Leaf, Node(Box<Tree>) }`)
//! can nest deep enough to overflow the stack of the decoding thread, which
//! aborts the process. [`DepthLimited`] wraps any [`Deserializer`] and passes
//! a depth budget down to every nested value: each time a nested value is
//! handed to a visitor (the elements of a sequence, the keys and values of a
//! map, struct fields, an enum's variant, `Some`, a newtype struct) one level
//! is used up, and a value nested more than `max_depth` levels deep fails with
//! the deserializer's own error: "nesting deeper than N levels".
//!
//! The budget travels by value through the wrappers (the visitor, the
//! sequence, map and enum accessors and the seeds), so the limit applies at
//! every level and siblings do not add up: only the depth of the path from the
//! root counts.

use std::fmt;

use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};

/// Default nesting limit: far beyond any sensible message, far below what
/// overflows a 2 MiB thread stack (debug builds included).
pub const DEFAULT_MAX_DEPTH: usize = 256;

/// The levels left below the current value, and the limit (for the message).
#[derive(Clone, Copy, Debug)]
struct Budget {
    left: usize,
    max: usize,
}

impl Budget {
    /// The budget one level further down, or the error if there is none left.
    #[inline]
    fn descend<E: de::Error>(self) -> Result<Budget, E> {
        match self.left.checked_sub(1) {
            Some(left) => Ok(Budget {
                left,
                max: self.max,
            }),
            None => Err(E::custom(format_args!(
                "nesting deeper than {} levels",
                self.max
            ))),
        }
    }
}

/// A [`Deserializer`] that fails on values nested more than `max_depth`
/// levels deep instead of recursing without bound.
///
/// ```
/// use dxnet_proto::depth::DepthLimited;
/// use serde::Deserialize;
///
/// let json = "[[[1]]]";
/// let mut de = serde_json::Deserializer::from_str(json);
/// assert!(Vec::<Vec<Vec<u8>>>::deserialize(DepthLimited::new(&mut de, 3)).is_ok());
/// let mut de = serde_json::Deserializer::from_str(json);
/// let err = Vec::<Vec<Vec<u8>>>::deserialize(DepthLimited::new(&mut de, 2)).unwrap_err();
/// assert!(err.to_string().contains("nesting deeper than 2 levels"));
/// ```
pub struct DepthLimited<D> {
    inner: D,
    budget: Budget,
}

impl<D> DepthLimited<D> {
    /// Wraps `inner`; values may nest up to `max_depth` levels deep (0: only
    /// scalars, strings and byte strings at the top level).
    pub fn new(inner: D, max_depth: usize) -> Self {
        DepthLimited {
            inner,
            budget: Budget {
                left: max_depth,
                max: max_depth,
            },
        }
    }

    /// Wraps `inner` with [`DEFAULT_MAX_DEPTH`].
    pub fn with_default_limit(inner: D) -> Self {
        Self::new(inner, DEFAULT_MAX_DEPTH)
    }

    /// The wrapped deserializer.
    pub fn into_inner(self) -> D {
        self.inner
    }
}

impl<D> fmt::Debug for DepthLimited<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DepthLimited")
            .field("levels_left", &self.budget.left)
            .field("max_depth", &self.budget.max)
            .finish_non_exhaustive()
    }
}

/// Forwards `deserialize_*` methods, wrapping the visitor.
macro_rules! forward_deserialize {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {$(
        #[inline]
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            self.inner.$method($($arg,)* Limited { inner: visitor, budget: self.budget })
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for DepthLimited<D> {
    type Error = D::Error;

    forward_deserialize! {
        deserialize_any();
        deserialize_bool();
        deserialize_i8();
        deserialize_i16();
        deserialize_i32();
        deserialize_i64();
        deserialize_i128();
        deserialize_u8();
        deserialize_u16();
        deserialize_u32();
        deserialize_u64();
        deserialize_u128();
        deserialize_f32();
        deserialize_f64();
        deserialize_char();
        deserialize_str();
        deserialize_string();
        deserialize_bytes();
        deserialize_byte_buf();
        deserialize_option();
        deserialize_unit();
        deserialize_unit_struct(name: &'static str);
        deserialize_newtype_struct(name: &'static str);
        deserialize_seq();
        deserialize_tuple(len: usize);
        deserialize_tuple_struct(name: &'static str, len: usize);
        deserialize_map();
        deserialize_struct(name: &'static str, fields: &'static [&'static str]);
        deserialize_enum(name: &'static str, variants: &'static [&'static str]);
        deserialize_identifier();
        deserialize_ignored_any();
    }

    #[inline]
    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

/// The wrapper of the visitors, accessors and seeds below a [`DepthLimited`]:
/// which trait it implements depends on what it wraps.
struct Limited<T> {
    inner: T,
    budget: Budget,
}

/// Forwards `visit_*` methods that carry a scalar (nothing nested).
macro_rules! forward_visit {
    ($($method:ident($ty:ty);)*) => {$(
        #[inline]
        fn $method<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
            self.inner.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Limited<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }

    forward_visit! {
        visit_bool(bool);
        visit_i8(i8);
        visit_i16(i16);
        visit_i32(i32);
        visit_i64(i64);
        visit_i128(i128);
        visit_u8(u8);
        visit_u16(u16);
        visit_u32(u32);
        visit_u64(u64);
        visit_u128(u128);
        visit_f32(f32);
        visit_f64(f64);
        visit_char(char);
        visit_str(&str);
        visit_borrowed_str(&'de str);
        visit_string(String);
        visit_bytes(&[u8]);
        visit_borrowed_bytes(&'de [u8]);
        visit_byte_buf(Vec<u8>);
    }

    #[inline]
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_none()
    }

    #[inline]
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_unit()
    }

    #[inline]
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let budget = self.budget.descend()?;
        self.inner.visit_some(DepthLimited { inner: d, budget })
    }

    #[inline]
    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let budget = self.budget.descend()?;
        self.inner
            .visit_newtype_struct(DepthLimited { inner: d, budget })
    }

    #[inline]
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        let budget = self.budget.descend()?;
        self.inner.visit_seq(Limited { inner: seq, budget })
    }

    #[inline]
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let budget = self.budget.descend()?;
        self.inner.visit_map(Limited { inner: map, budget })
    }

    #[inline]
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        let budget = self.budget.descend()?;
        self.inner.visit_enum(Limited {
            inner: data,
            budget,
        })
    }
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Limited<S> {
    type Value = S::Value;

    #[inline]
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.inner.deserialize(DepthLimited {
            inner: d,
            budget: self.budget,
        })
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Limited<A> {
    type Error = A::Error;

    #[inline]
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        self.inner.next_element_seed(Limited {
            inner: seed,
            budget: self.budget,
        })
    }

    #[inline]
    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Limited<A> {
    type Error = A::Error;

    #[inline]
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        self.inner.next_key_seed(Limited {
            inner: seed,
            budget: self.budget,
        })
    }

    #[inline]
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        self.inner.next_value_seed(Limited {
            inner: seed,
            budget: self.budget,
        })
    }

    #[inline]
    fn next_entry_seed<K: DeserializeSeed<'de>, V: DeserializeSeed<'de>>(
        &mut self,
        kseed: K,
        vseed: V,
    ) -> Result<Option<(K::Value, V::Value)>, A::Error> {
        let budget = self.budget;
        self.inner.next_entry_seed(
            Limited {
                inner: kseed,
                budget,
            },
            Limited {
                inner: vseed,
                budget,
            },
        )
    }

    #[inline]
    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

impl<'de, A: EnumAccess<'de>> EnumAccess<'de> for Limited<A> {
    type Error = A::Error;
    type Variant = Limited<A::Variant>;

    #[inline]
    fn variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<(S::Value, Self::Variant), A::Error> {
        let budget = self.budget;
        let (value, variant) = self.inner.variant_seed(Limited {
            inner: seed,
            budget,
        })?;
        Ok((
            value,
            Limited {
                inner: variant,
                budget,
            },
        ))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for Limited<A> {
    type Error = A::Error;

    #[inline]
    fn unit_variant(self) -> Result<(), A::Error> {
        self.inner.unit_variant()
    }

    #[inline]
    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, A::Error> {
        self.inner.newtype_variant_seed(Limited {
            inner: seed,
            budget: self.budget,
        })
    }

    #[inline]
    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        self.inner.tuple_variant(
            len,
            Limited {
                inner: visitor,
                budget: self.budget,
            },
        )
    }

    #[inline]
    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        self.inner.struct_variant(
            fields,
            Limited {
                inner: visitor,
                budget: self.budget,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    use super::*;

    fn json<'a, T: Deserialize<'a>>(s: &'a str, max: usize) -> Result<T, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(s);
        T::deserialize(DepthLimited::new(&mut de, max))
    }

    fn is_depth_error<T: fmt::Debug>(r: Result<T, serde_json::Error>, max: usize) -> bool {
        match r {
            Ok(v) => panic!("decoded {v:?}"),
            Err(e) => e
                .to_string()
                .contains(&format!("nesting deeper than {max} levels")),
        }
    }

    #[derive(Deserialize, Debug, PartialEq)]
    enum Tree {
        Leaf,
        Node(Box<Tree>),
        Pair(Box<Tree>, Box<Tree>),
        Named { child: Box<Tree> },
    }

    #[test]
    fn sequences_count_each_level() {
        assert_eq!(json::<Vec<Vec<u8>>>("[[1,2],[3]]", 2).unwrap().len(), 2);
        assert!(is_depth_error(json::<Vec<Vec<u8>>>("[[1,2],[3]]", 1), 1));
        // Siblings do not add up.
        let wide = format!("[{}]", vec!["[1]"; 1000].join(","));
        assert_eq!(json::<Vec<Vec<u8>>>(&wide, 2).unwrap().len(), 1000);
        // Scalars need no level.
        assert_eq!(json::<u32>("7", 0).unwrap(), 7);
        assert_eq!(json::<String>("\"x\"", 0).unwrap(), "x");
        assert!(is_depth_error(json::<Vec<u8>>("[]", 0), 0));
    }

    #[test]
    fn maps_options_and_enums_count() {
        let m: BTreeMap<String, Vec<u8>> = json(r#"{"a":[1],"b":[]}"#, 2).unwrap();
        assert_eq!(m["a"], vec![1]);
        assert!(is_depth_error(
            json::<BTreeMap<String, Vec<u8>>>(r#"{"a":[1]}"#, 1),
            1
        ));
        // serde_json hands `Some` to the visitor, so it is a level.
        assert_eq!(json::<Option<u8>>("3", 1).unwrap(), Some(3));
        assert!(is_depth_error(json::<Option<u8>>("3", 0), 0));
        assert_eq!(json::<Option<u8>>("null", 0).unwrap(), None);

        let t = r#"{"Node":{"Pair":["Leaf",{"Named":{"child":"Leaf"}}]}}"#;
        // Node (1), Pair (enum 1 + tuple 1), Named (enum 1 + struct 1), Leaf (1).
        assert!(json::<Tree>(t, 6).is_ok());
        assert!(is_depth_error(json::<Tree>(t, 5), 5));
    }

    #[test]
    fn deep_json_fails_cleanly() {
        // (serde_json has its own limit of 128 levels: stay below it.)
        let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
        #[derive(Deserialize, Debug)]
        struct Any(Vec<Any>);
        // Each `Any` is two levels: the newtype struct and its sequence.
        assert_eq!(json::<Any>(&deep, 200).unwrap().0.len(), 1);
        assert!(is_depth_error(json::<Any>(&deep, 199), 199));
        assert!(is_depth_error(json::<Any>(&deep, 50), 50));
    }
}
