//! Stop conditions: EOS ids and stop strings matched across token boundaries.
