//! The prefix cache: copies of sequence states at known token prefixes, so that a request whose
//! prompt starts with one (the next turn of a conversation, another conversation with the same
//! system prompt and tools) prefills only the rest.
//!
//! A Gated DeltaNet layer's recurrent state cannot be rolled back to an earlier position, so a
//! state serves exactly the tokens it has seen: an entry is usable when its tokens are a prefix
//! of the new prompt, and the longest usable entry wins. The engine makes entries where a request
//! asks (chat: where its last message starts) and from the state of a sequence that finished.
//! When the cache is full the least recently used entry goes.

/// Prefixes shorter than this are not worth an entry: on the GPU each one costs a prefill call
/// of its own (the prompt is split there) and, held, a whole sequence slot.
pub const MIN_CACHED_PREFIX: usize = 64;

/// Sequence states keyed by the tokens they have seen.
pub struct PrefixCache<S> {
    capacity: usize,
    entries: Vec<Entry<S>>,
    /// Advances on every use; an entry's `last_used` orders evictions.
    clock: u64,
}

struct Entry<S> {
    tokens: Vec<u32>,
    state: S,
    last_used: u64,
}

impl<S> PrefixCache<S> {
    /// A cache of at most `capacity` states (0 keeps none).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: Vec::new(),
            clock: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest entry whose tokens start `prompt` and leave at least one of its tokens to
    /// prefill (the next token's logits come from prefilling the last one): its length and state.
    pub fn longest_prefix(&mut self, prompt: &[u32]) -> Option<(usize, &S)> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|(_, e)| e.tokens.len())
            .map(|(i, _)| i)?;
        let entry = self.touch(best);
        Some((entry.tokens.len(), &entry.state))
    }

    /// Whether an entry holds exactly `tokens` (counted as a use, so it stays).
    pub fn contains(&mut self, tokens: &[u32]) -> bool {
        match self.entries.iter().position(|e| e.tokens == tokens) {
            Some(i) => {
                self.touch(i);
                true
            }
            None => false,
        }
    }

    /// Whether the cache keeps anything: with capacity 0 there is no point copying a state.
    pub fn is_enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Drops least recently used entries until one more fits. Call it before making the state to
    /// insert, so that a backend with a fixed pool of states has one free for it.
    pub fn make_room(&mut self) {
        while !self.entries.is_empty() && self.entries.len() >= self.capacity {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
                .expect("the cache is not empty");
            self.entries.swap_remove(oldest);
        }
    }

    /// Keeps `state` as the state after `tokens`, replacing an entry of the same tokens and
    /// evicting the least recently used one if the cache is full. With capacity 0 it is dropped.
    pub fn insert(&mut self, tokens: Vec<u32>, state: S) {
        if !self.is_enabled() {
            return;
        }
        self.entries.retain(|e| e.tokens != tokens);
        self.make_room();
        self.clock += 1;
        self.entries.push(Entry {
            tokens,
            state,
            last_used: self.clock,
        });
    }

    fn touch(&mut self, i: usize) -> &Entry<S> {
        self.clock += 1;
        let entry = &mut self.entries[i];
        entry.last_used = self.clock;
        entry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_strict_prefix_wins() {
        let mut cache = PrefixCache::new(4);
        cache.insert(vec![1, 2], "ab");
        cache.insert(vec![1, 2, 3, 4], "abcd");
        cache.insert(vec![1, 2, 9], "ab9");
        cache.insert(vec![5], "e");
        assert_eq!(cache.longest_prefix(&[1, 2, 3, 4, 5]), Some((4, &"abcd")));
        assert_eq!(cache.longest_prefix(&[1, 2, 3]), Some((2, &"ab")));
        assert_eq!(cache.longest_prefix(&[1, 2, 9, 9]), Some((3, &"ab9")));
        // An entry equal to the whole prompt leaves nothing to prefill, so a shorter one serves.
        assert_eq!(cache.longest_prefix(&[1, 2, 3, 4]), Some((2, &"ab")));
        assert_eq!(cache.longest_prefix(&[1]), None);
        assert_eq!(cache.longest_prefix(&[2, 1, 3]), None);
        assert_eq!(cache.longest_prefix(&[]), None);
    }

    #[test]
    fn the_least_recently_used_entry_is_evicted() {
        let mut cache = PrefixCache::new(2);
        cache.insert(vec![1], 1);
        cache.insert(vec![2], 2);
        // A hit refreshes the first entry, so the second is the one to go.
        assert_eq!(cache.longest_prefix(&[1, 7]), Some((1, &1)));
        cache.insert(vec![3], 3);
        assert_eq!(cache.len(), 2);
        assert!(cache.contains(&[1]));
        assert!(!cache.contains(&[2]));
        assert!(cache.contains(&[3]));
        // `contains` counts as a use too: now 1 is the oldest.
        cache.insert(vec![4], 4);
        assert!(!cache.contains(&[1]));
        assert!(cache.contains(&[3]) && cache.contains(&[4]));
    }

    #[test]
    fn the_same_tokens_replace_their_entry() {
        let mut cache = PrefixCache::new(3);
        cache.insert(vec![1, 2], "old");
        cache.insert(vec![3], "other");
        cache.insert(vec![1, 2], "new");
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.longest_prefix(&[1, 2, 3]), Some((2, &"new")));
    }

    #[test]
    fn make_room_leaves_a_free_place() {
        let mut cache = PrefixCache::new(2);
        cache.make_room();
        assert!(cache.is_empty());
        cache.insert(vec![1], ());
        cache.insert(vec![2], ());
        cache.make_room();
        assert_eq!(cache.len(), 1);
        assert!(cache.contains(&[2]));
    }

    #[test]
    fn capacity_zero_keeps_nothing() {
        let mut cache = PrefixCache::new(0);
        assert!(!cache.is_enabled());
        cache.insert(vec![1], ());
        cache.make_room();
        assert!(cache.is_empty());
        assert_eq!(cache.longest_prefix(&[1, 2]), None);
    }
}
