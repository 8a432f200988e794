#include "examples/classify/reviews.h"

#include <algorithm>
#include <random>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace classify {
namespace {

const std::vector<std::string> kPositive = {"good",     "great",    "clean",  "quiet",   "friendly", "comfortable",
                                            "spacious", "helpful",  "lovely", "perfect", "excellent", "convenient"};
const std::vector<std::string> kNegative = {"dirty", "noisy",  "rude",    "small", "broken", "smelly",
                                            "slow",  "cold",   "awful",   "poor",  "cramped", "expensive"};
const std::vector<std::string> kNeutral = {"the",   "room",    "staff", "bed",      "breakfast", "location", "was",
                                           "and",   "hotel",   "very",  "bathroom", "view",      "service",  "we",
                                           "stayed", "night",  "price", "lobby",    "it",        "is"};

}  // namespace

std::vector<Review> generate_reviews(int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](const std::vector<std::string>& words) {
    return words[std::uniform_int_distribution<size_t>(0, words.size() - 1)(rng)];
  };
  auto chance = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  std::vector<Review> out;
  out.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t label = chance(0.5) ? 1 : 0;
    std::vector<std::string> words;
    const int neutral = std::uniform_int_distribution<int>(3, 8)(rng);
    for (int k = 0; k < neutral; ++k) words.push_back(pick(kNeutral));
    // Opinions for the label: plain words of its polarity, or "not" + the other polarity.
    const int opinions = std::uniform_int_distribution<int>(1, 3)(rng);
    for (int k = 0; k < opinions; ++k) {
      std::vector<std::string> phrase;
      if (chance(0.3)) {
        phrase = {"not", pick(label ? kNegative : kPositive)};
      } else {
        phrase = {pick(label ? kPositive : kNegative)};
      }
      const size_t at = std::uniform_int_distribution<size_t>(0, words.size())(rng);
      words.insert(words.begin() + static_cast<std::ptrdiff_t>(at), phrase.begin(), phrase.end());
    }
    // A weaker opposite opinion after "but", outnumbered by the main ones.
    if (opinions >= 2 && chance(0.3)) {
      words.push_back("but");
      words.push_back(pick(label ? kNegative : kPositive));
    }
    std::string text;
    for (const auto& w : words) text += (text.empty() ? "" : " ") + w;
    out.push_back({text, label});
  }
  return out;
}

Vocabulary::Vocabulary() {
  words_ = {"[PAD]", "[CLS]", "not", "but"};
  for (const auto* list : {&kPositive, &kNegative, &kNeutral}) words_.insert(words_.end(), list->begin(), list->end());
  for (size_t i = 0; i < words_.size(); ++i) index_.emplace(words_[i], static_cast<int64_t>(i));
}

std::vector<int64_t> Vocabulary::encode(const std::string& text, int64_t length) const {
  std::vector<int64_t> ids{1};
  std::istringstream in(text);
  for (std::string w; in >> w;) {
    auto it = index_.find(w);
    if (it == index_.end()) throw std::runtime_error("unknown word '" + w + "'");
    ids.push_back(it->second);
  }
  ids.resize(static_cast<size_t>(length), 0);
  return ids;
}

}  // namespace classify
