//! Scripts, each sent by its hash (EVALSHA); on NOSCRIPT (Redis flushed, restarted
//! or failed over) the same call is sent again with the whole body (EVAL), which runs
//! and caches it in one step. (SCRIPT LOAD, then EVALSHA again, fails when another
//! flush lands between the two.)

use ::redis::{Arg, Cmd, FromRedisValue, ParsingError, ToRedisArgs, Value};

/// A Lua script and its SHA1.
pub struct Script {
    code: ::redis::Script,
    body: String,
}

impl Script {
    pub fn new(body: &str) -> Script {
        Script {
            code: ::redis::Script::new(body),
            body: body.to_string(),
        }
    }

    pub fn hash(&self) -> &str {
        self.code.get_hash()
    }

    pub fn body(&self) -> &str {
        &self.body
    }

    /// A call of this script on `keys` keys: push the keys, then the arguments.
    pub fn call(&self, keys: usize) -> Eval<'_> {
        self.call_sized(keys, 0, 0)
    }

    /// `call`, with room for `args` more arguments of `bytes` bytes in all.
    pub fn call_sized(&self, keys: usize, args: usize, bytes: usize) -> Eval<'_> {
        let hash = self.hash();
        let mut cmd = Cmd::with_capacity(3 + args, 7 + hash.len() + 20 + bytes);
        cmd.arg("EVALSHA").arg(hash).arg(keys);
        Eval { script: self, cmd }
    }

    /// `SCRIPT LOAD` of this script (on a cluster, on every primary).
    pub(super) fn load(&self) -> ::redis::ScriptInvocation<'_> {
        self.code.prepare_invoke()
    }
}

/// A script's reply of numbers, sent packed: one string of little-endian doubles,
/// 8 bytes each (`struct.pack('<d...', ...)` in the script), which Redis sends and
/// the client reads as one value, where an array of integers costs a value each on
/// both sides. Each number is truncated toward zero, as Redis turns a Lua number
/// into an integer reply. An array of integers is read too.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Numbers(pub Vec<i64>);

impl Numbers {
    /// `packed`, 8 bytes a number: None if its length is not a multiple of 8.
    pub fn unpack(packed: &[u8]) -> Option<Numbers> {
        if !packed.len().is_multiple_of(8) {
            return None;
        }
        let numbers = packed
            .chunks_exact(8)
            .map(|d| {
                let d: [u8; 8] = d.try_into().unwrap_or_default();
                f64::from_le_bytes(d) as i64
            })
            .collect();
        Some(Numbers(numbers))
    }
}

impl FromRedisValue for Numbers {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        match v {
            Value::BulkString(packed) => Numbers::unpack(&packed).ok_or_else(|| {
                ParsingError::from(format!(
                    "{} bytes are not numbers packed 8 bytes each",
                    packed.len()
                ))
            }),
            v => Vec::<i64>::from_redis_value(v).map(Numbers),
        }
    }
}

/// A script call: EVALSHA with its hash, its keys and arguments.
pub struct Eval<'s> {
    script: &'s Script,
    cmd: Cmd,
}

impl Eval<'_> {
    pub fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.cmd.arg(arg);
        self
    }
}

/// What `Shared::call` sends: a command, or a script call.
pub trait Request {
    /// The command as sent first.
    fn cmd(&self) -> &Cmd;
    /// The script it runs by hash, to send whole after NOSCRIPT.
    fn script(&self) -> Option<&Script> {
        None
    }
}

impl Request for Cmd {
    fn cmd(&self) -> &Cmd {
        self
    }
}

impl Request for Eval<'_> {
    fn cmd(&self) -> &Cmd {
        &self.cmd
    }

    fn script(&self) -> Option<&Script> {
        Some(self.script)
    }
}

/// The EVAL of `evalsha`'s script, same keys and arguments, with the whole body.
pub(super) fn whole(script: &Script, evalsha: &Cmd) -> Cmd {
    let mut eval = Cmd::with_capacity(evalsha.args_iter().len(), script.body.len() + 64);
    eval.arg("EVAL").arg(script.body.as_str());
    for a in evalsha.args_iter().skip(2) {
        if let Arg::Simple(bytes) = a {
            eval.arg(bytes);
        }
    }
    eval
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_call_has_the_body_and_the_same_keys_and_arguments() {
        let s = Script::new("return KEYS[1]");
        let mut call = s.call(1);
        call.arg("k").arg(7);
        let sha = call.cmd().get_packed_command();
        let text = String::from_utf8_lossy(&sha);
        assert!(
            text.contains("EVALSHA") && text.contains(s.hash()),
            "{text}"
        );
        let eval = whole(&s, call.cmd()).get_packed_command();
        let mut want = Cmd::new();
        want.arg("EVAL")
            .arg("return KEYS[1]")
            .arg(1)
            .arg("k")
            .arg(7);
        assert_eq!(eval, want.get_packed_command());
    }

    #[test]
    fn numbers_are_read_packed_as_redis_would_read_them_as_integers() {
        let sent = [0.0, 3.0, -1.0, 1_764_340_000_123_456.0, 2.9, -2.9, -1e3];
        let packed: Vec<u8> = sent.iter().flat_map(|d: &f64| d.to_le_bytes()).collect();
        let want = vec![0, 3, -1, 1_764_340_000_123_456, 2, -2, -1000];
        let read = Numbers::from_redis_value(Value::BulkString(packed.clone())).unwrap();
        assert_eq!(read, Numbers(want.clone()));
        // The same numbers as an array of integers.
        let array = Value::Array(want.iter().map(|&n| Value::Int(n)).collect());
        assert_eq!(Numbers::from_redis_value(array).unwrap(), Numbers(want));
        assert_eq!(
            Numbers::from_redis_value(Value::BulkString(Vec::new())).unwrap(),
            Numbers(Vec::new())
        );
        // Not a whole number of doubles.
        let cut = Value::BulkString(packed[..packed.len() - 3].to_vec());
        assert!(Numbers::from_redis_value(cut).is_err());
    }
}
