// "Did you mean" hints for misspelled configuration keys.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace forge {

// Levenshtein distance (insertions, deletions, substitutions).
size_t edit_distance(std::string_view a, std::string_view b);

// "; did you mean 'X'?" for the closest candidate within edit distance 2, or "" when none is that close.
std::string did_you_mean(std::string_view name, const std::vector<std::string_view>& candidates);

}  // namespace forge
