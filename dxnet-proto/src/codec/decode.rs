//! A serde [`Deserializer`] for postcard's wire format that keeps errors'
//! text and limits nesting.
//!
//! postcard's own deserializer is `no_std`: it replaces the text of every
//! error a `Deserialize` impl raises with "Serde Deserialization Error", so
//! two builds disagreeing on a message enum would see no reason. Limiting
//! its depth by wrapping it costs twice its decode time (an error
//! translation at every level), while a counter here costs a compare.
//!
//! It is stricter than postcard in two ways, both for untrusted input: a
//! varint must not end in zero groups (postcard never writes them, so every
//! value has one encoding), and a sequence or map may hold at most
//! [`ZERO_SIZED_MAX`] more elements than it has bytes left (elements of
//! zero size, as `Vec<()>`, would otherwise let 10 bytes claim 2^63
//! iterations).

use std::fmt;

use serde::de::{
    self, DeserializeSeed, EnumAccess, IntoDeserializer, MapAccess, SeqAccess, VariantAccess,
    Visitor,
};

use super::MAX_DEPTH;

/// Elements of a sequence or map decoded beyond the bytes they had: the
/// work a payload can claim without carrying it.
pub(super) const ZERO_SIZED_MAX: usize = 1 << 16;

/// Why a payload did not decode. Boxed, so that results stay one word and
/// the decoder's fast paths stay fast.
#[derive(Debug)]
pub(super) struct Error(
    #[allow(clippy::box_collection)] // one pointer wide, not three
    pub(super)  Box<String>,
);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl de::Error for Error {
    #[cold]
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Error(Box::new(msg.to_string()))
    }
}

type Result<T> = std::result::Result<T, Error>;

#[cold]
fn err(msg: &str) -> Error {
    Error(Box::new(msg.to_owned()))
}

#[cold]
fn eof() -> Error {
    err("payload ends inside a value")
}

/// The decoder over one payload.
pub(super) struct Decoder<'de> {
    input: &'de [u8],
    depth: usize,
    zero_sized_left: usize,
}

impl<'de> Decoder<'de> {
    pub(super) fn new(input: &'de [u8]) -> Self {
        Decoder {
            input,
            depth: 0,
            zero_sized_left: ZERO_SIZED_MAX,
        }
    }

    /// The bytes not decoded yet.
    pub(super) fn rest(&self) -> &'de [u8] {
        self.input
    }

    #[inline]
    fn byte(&mut self) -> Result<u8> {
        match self.input.split_first() {
            Some((&b, rest)) => {
                self.input = rest;
                Ok(b)
            }
            None => Err(eof()),
        }
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'de [u8]> {
        if n > self.input.len() {
            return Err(eof());
        }
        let (head, tail) = self.input.split_at(n);
        self.input = tail;
        Ok(head)
    }

    #[inline]
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let b = self.take(N)?;
        // The length was checked by `take`.
        Ok(b.try_into().expect("N bytes"))
    }

    /// An unsigned varint of at most `BITS` bits (LEB128, low group first).
    #[inline]
    fn varint<const BITS: u32>(&mut self) -> Result<u64> {
        if let Some((&b, rest)) = self.input.split_first() {
            if b < 0x80 {
                self.input = rest;
                return Ok(u64::from(b));
            }
        }
        self.varint_long::<BITS>()
    }

    fn varint_long<const BITS: u32>(&mut self) -> Result<u64> {
        let groups = BITS.div_ceil(7);
        let mut v = 0u64;
        for i in 0..groups {
            let b = self.byte()?;
            let part = u64::from(b & 0x7f);
            let shift = i * 7;
            if i == groups - 1 && (b & 0x80 != 0 || part >> (BITS - shift) != 0) {
                return Err(err("varint overflows its type"));
            }
            v |= part << shift;
            if b & 0x80 == 0 {
                if part == 0 && i > 0 {
                    return Err(err("varint ends in a zero group"));
                }
                return Ok(v);
            }
        }
        Err(err("varint overflows its type"))
    }

    fn varint_u128(&mut self) -> Result<u128> {
        const GROUPS: u32 = 128u32.div_ceil(7);
        let mut v = 0u128;
        for i in 0..GROUPS {
            let b = self.byte()?;
            let part = u128::from(b & 0x7f);
            let shift = i * 7;
            if i == GROUPS - 1 && (b & 0x80 != 0 || part >> (128 - shift) != 0) {
                return Err(err("varint overflows its type"));
            }
            v |= part << shift;
            if b & 0x80 == 0 {
                if part == 0 && i > 0 {
                    return Err(err("varint ends in a zero group"));
                }
                return Ok(v);
            }
        }
        Err(err("varint overflows its type"))
    }

    #[inline]
    fn len(&mut self) -> Result<usize> {
        usize::try_from(self.varint::<64>()?).map_err(|_| err("length beyond this platform"))
    }

    #[inline]
    fn str(&mut self) -> Result<&'de str> {
        let n = self.len()?;
        std::str::from_utf8(self.take(n)?).map_err(<Error as de::Error>::custom)
    }

    /// Runs `f` one level deeper, or fails past [`MAX_DEPTH`]: derived
    /// impls recurse once per level, so unbounded nesting would overflow
    /// the decoding thread's stack.
    #[inline]
    fn nested<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.depth == MAX_DEPTH {
            return Err(de::Error::custom(format_args!(
                "nesting deeper than {MAX_DEPTH} levels"
            )));
        }
        self.depth += 1;
        let r = f(self);
        self.depth -= 1;
        r
    }

    /// Accounts for one element of a sequence or map with `left` elements
    /// (this one included) still to come.
    #[inline]
    fn element(&mut self, left: usize) -> Result<()> {
        if left > self.input.len() {
            self.zero_sized_left = self
                .zero_sized_left
                .checked_sub(1)
                .ok_or_else(|| err("more elements than the payload has bytes"))?;
        }
        Ok(())
    }
}

macro_rules! unsigned {
    ($($method:ident $visit:ident $ty:ty;)*) => {$(
        #[inline]
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
            visitor.$visit(self.varint::<{ <$ty>::BITS }>()? as $ty)
        }
    )*};
}

macro_rules! signed {
    ($($method:ident $visit:ident $ty:ty, $uty:ty;)*) => {$(
        #[inline]
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
            let z = self.varint::<{ <$uty>::BITS }>()? as $uty;
            // Zigzag: 0, -1, 1, -2, ... as 0, 1, 2, 3, ...
            visitor.$visit(((z >> 1) as $ty) ^ -((z & 1) as $ty))
        }
    )*};
}

impl<'de> de::Deserializer<'de> for &mut Decoder<'de> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value> {
        Err(err(
            "the payload format is not self-describing: untagged enums, \
             flattened fields and other `deserialize_any` types cannot be decoded",
        ))
    }

    #[inline]
    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self.byte()? {
            0 => visitor.visit_bool(false),
            1 => visitor.visit_bool(true),
            _ => Err(err("bool is neither 0 nor 1")),
        }
    }

    #[inline]
    fn deserialize_i8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_i8(self.byte()? as i8)
    }

    #[inline]
    fn deserialize_u8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_u8(self.byte()?)
    }

    unsigned! {
        deserialize_u16 visit_u16 u16;
        deserialize_u32 visit_u32 u32;
        deserialize_u64 visit_u64 u64;
    }

    signed! {
        deserialize_i16 visit_i16 i16, u16;
        deserialize_i32 visit_i32 i32, u32;
        deserialize_i64 visit_i64 i64, u64;
    }

    fn deserialize_u128<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_u128(self.varint_u128()?)
    }

    fn deserialize_i128<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let z = self.varint_u128()?;
        visitor.visit_i128(((z >> 1) as i128) ^ -((z & 1) as i128))
    }

    #[inline]
    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_f32(f32::from_le_bytes(self.array()?))
    }

    #[inline]
    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_f64(f64::from_le_bytes(self.array()?))
    }

    fn deserialize_char<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let s = self.str()?;
        let mut chars = s.chars();
        match (chars.next(), chars.next()) {
            (Some(c), None) => visitor.visit_char(c),
            _ => Err(err("char is not one UTF-8 character")),
        }
    }

    #[inline]
    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_borrowed_str(self.str()?)
    }

    #[inline]
    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.deserialize_str(visitor)
    }

    #[inline]
    fn deserialize_bytes<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let n = self.len()?;
        visitor.visit_borrowed_bytes(self.take(n)?)
    }

    #[inline]
    fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.deserialize_bytes(visitor)
    }

    #[inline]
    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self.byte()? {
            0 => visitor.visit_none(),
            1 => self.nested(|d| visitor.visit_some(d)),
            _ => Err(err("Option tag is neither 0 nor 1")),
        }
    }

    #[inline]
    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_unit()
    }

    #[inline]
    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value> {
        visitor.visit_unit()
    }

    #[inline]
    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value> {
        self.nested(|d| visitor.visit_newtype_struct(d))
    }

    #[inline]
    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let left = self.len()?;
        self.nested(|de| visitor.visit_seq(Elements { de, left }))
    }

    #[inline]
    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value> {
        self.nested(|de| visitor.visit_seq(Fields { de, left: len }))
    }

    #[inline]
    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value> {
        self.deserialize_tuple(len, visitor)
    }

    #[inline]
    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let left = self.len()?;
        self.nested(|de| visitor.visit_map(Elements { de, left }))
    }

    #[inline]
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        self.deserialize_tuple(fields.len(), visitor)
    }

    #[inline]
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        self.nested(|d| visitor.visit_enum(d))
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value> {
        Err(err(
            "the payload format has no field names: identifiers cannot be decoded",
        ))
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value> {
        Err(err(
            "the payload format is not self-describing: values cannot be skipped",
        ))
    }

    fn is_human_readable(&self) -> bool {
        false
    }
}

/// The elements of a sequence or the entries of a map, after their count.
struct Elements<'a, 'de> {
    de: &'a mut Decoder<'de>,
    left: usize,
}

impl<'de> SeqAccess<'de> for Elements<'_, 'de> {
    type Error = Error;

    #[inline]
    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.de.element(self.left)?;
        self.left -= 1;
        seed.deserialize(&mut *self.de).map(Some)
    }

    fn size_hint(&self) -> Option<usize> {
        // What the payload can hold, so a hostile count cannot make the
        // visitor reserve more than the bytes that came.
        Some(self.left.min(self.de.input.len()))
    }
}

impl<'de> MapAccess<'de> for Elements<'_, 'de> {
    type Error = Error;

    #[inline]
    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.de.element(self.left)?;
        self.left -= 1;
        seed.deserialize(&mut *self.de).map(Some)
    }

    #[inline]
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value> {
        seed.deserialize(&mut *self.de)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.left.min(self.de.input.len()))
    }
}

/// The fields of a tuple or struct (their number is in the type).
struct Fields<'a, 'de> {
    de: &'a mut Decoder<'de>,
    left: usize,
}

impl<'de> SeqAccess<'de> for Fields<'_, 'de> {
    type Error = Error;

    #[inline]
    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(&mut *self.de).map(Some)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.left)
    }
}

impl<'de> EnumAccess<'de> for &mut Decoder<'de> {
    type Error = Error;
    type Variant = Self;

    #[inline]
    fn variant_seed<V: DeserializeSeed<'de>>(self, seed: V) -> Result<(V::Value, Self)> {
        let index = self.varint::<32>()? as u32;
        let v = seed.deserialize(IntoDeserializer::<Error>::into_deserializer(index))?;
        Ok((v, self))
    }
}

impl<'de> VariantAccess<'de> for &mut Decoder<'de> {
    type Error = Error;

    #[inline]
    fn unit_variant(self) -> Result<()> {
        Ok(())
    }

    #[inline]
    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value> {
        seed.deserialize(self)
    }

    #[inline]
    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value> {
        visitor.visit_seq(Fields {
            de: self,
            left: len,
        })
    }

    #[inline]
    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        visitor.visit_seq(Fields {
            de: self,
            left: fields.len(),
        })
    }
}
