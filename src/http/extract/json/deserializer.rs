//! [`Json`] as a serde deserializer. What a type asks for decides the words of a misfit
//! where the JSON type is fixed by it (a number, an array, an object); for a string
//! (`deserialize_str`, which types of their own read too: a time) the value is handed
//! to the visitor as it is, which refuses it in its own words, as serde_json does.

use serde::de::{self, DeserializeSeed, Visitor};

use super::{Json, Misfit};

macro_rules! integers {
    ($($method:ident: $t:ty),*) => {$(
        fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Misfit> {
            self.integer(v, <$t>::MIN.into(), <$t>::MAX.into())
        }
    )*};
}

impl<'de> de::Deserializer<'de> for Json {
    type Error = Misfit;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Misfit> {
        match self {
            Json::Null => v.visit_unit(),
            Json::Bool(b) => v.visit_bool(b),
            Json::Unsigned(n) => v.visit_u64(n),
            Json::Signed(n) => v.visit_i64(n),
            Json::Float(n) => v.visit_f64(n),
            Json::String(s) => v.visit_string(s),
            Json::Array(items) => visit_array(items, v),
            Json::Object(members) => visit_object(members, v),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Misfit> {
        match self {
            Json::Bool(b) => v.visit_bool(b),
            other => Err(other.misfit("a boolean")),
        }
    }

    integers!(deserialize_i8: i8, deserialize_i16: i16, deserialize_i32: i32, deserialize_i64: i64);
    integers!(deserialize_u8: u8, deserialize_u16: u16, deserialize_u32: u32, deserialize_u64: u64);

    fn deserialize_f32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Misfit> {
        self.deserialize_f64(v)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Misfit> {
        match self {
            Json::Unsigned(_) | Json::Signed(_) | Json::Float(_) => self.deserialize_any(v),
            other => Err(other.misfit("a number")),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Misfit> {
        match self {
            Json::Null => v.visit_none(),
            other => v.visit_some(other),
        }
    }

    fn deserialize_unit<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Misfit> {
        match self {
            Json::Null => v.visit_unit(),
            other => Err(other.misfit("null")),
        }
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        v: V,
    ) -> Result<V::Value, Misfit> {
        self.deserialize_unit(v)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        v: V,
    ) -> Result<V::Value, Misfit> {
        v.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Misfit> {
        match self {
            Json::Array(items) => visit_array(items, v),
            other => Err(other.misfit("an array")),
        }
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _len: usize, v: V) -> Result<V::Value, Misfit> {
        self.deserialize_seq(v)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        v: V,
    ) -> Result<V::Value, Misfit> {
        self.deserialize_seq(v)
    }

    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Misfit> {
        match self {
            Json::Object(members) => visit_object(members, v),
            other => Err(other.misfit("an object")),
        }
    }

    /// From an object only: serde_json would read a struct from an array of its fields.
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Misfit> {
        self.deserialize_map(v)
    }

    /// A variant as serde_json writes one: `"name"`, or `{"name": its value}`.
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Misfit> {
        match self {
            Json::String(name) => v.visit_enum(Variant(name, Json::Null)),
            Json::Object(mut members) if members.len() == 1 => {
                let (name, value) = members.pop().expect("one member");
                v.visit_enum(Variant(name, value))
            }
            other => Err(other.misfit("a string, or an object of one member")),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Misfit> {
        v.visit_unit()
    }

    serde::forward_to_deserialize_any! {
        i128 u128 char str string bytes byte_buf identifier
    }
}

fn visit_array<'de, V: Visitor<'de>>(items: Vec<Json>, v: V) -> Result<V::Value, Misfit> {
    let len = items.len();
    let mut items = Elements(items.into_iter());
    let value = v.visit_seq(&mut items)?;
    match items.0.len() {
        0 => Ok(value),
        left => Err(Misfit(format!(
            "expected an array of {} elements, not {len}",
            len - left
        ))),
    }
}

fn visit_object<'de, V: Visitor<'de>>(
    members: Vec<(String, Json)>,
    v: V,
) -> Result<V::Value, Misfit> {
    let len = members.len();
    let mut members = Members(members.into_iter(), None);
    let value = v.visit_map(&mut members)?;
    match members.0.len() {
        0 => Ok(value),
        left => Err(Misfit(format!(
            "expected an object of {} members, not {len}",
            len - left
        ))),
    }
}

struct Elements(std::vec::IntoIter<Json>);

impl<'de> de::SeqAccess<'de> for Elements {
    type Error = Misfit;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Misfit> {
        self.0.next().map(|item| seed.deserialize(item)).transpose()
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

/// An object's members, and the value of the one whose name was just read.
struct Members(std::vec::IntoIter<(String, Json)>, Option<Json>);

impl<'de> de::MapAccess<'de> for Members {
    type Error = Misfit;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Misfit> {
        let Some((name, value)) = self.0.next() else {
            return Ok(None);
        };
        self.1 = Some(value);
        seed.deserialize(Json::String(name)).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Misfit> {
        seed.deserialize(self.1.take().unwrap_or(Json::Null))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

/// A variant's name and value (`null` for a unit variant written as a string).
struct Variant(String, Json);

impl<'de> de::EnumAccess<'de> for Variant {
    type Error = Misfit;
    type Variant = Json;

    fn variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<(T::Value, Json), Misfit> {
        Ok((seed.deserialize(Json::String(self.0))?, self.1))
    }
}

impl<'de> de::VariantAccess<'de> for Json {
    type Error = Misfit;

    fn unit_variant(self) -> Result<(), Misfit> {
        de::Deserializer::deserialize_unit(self, de::IgnoredAny).map(|_| ())
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, Misfit> {
        seed.deserialize(self)
    }

    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, v: V) -> Result<V::Value, Misfit> {
        de::Deserializer::deserialize_seq(self, v)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        _fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Misfit> {
        de::Deserializer::deserialize_map(self, v)
    }
}
